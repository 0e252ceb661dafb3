"""Dev mode's server secret: random per data directory (0600), never a public constant;
and the worker-token and metrics settings."""

from __future__ import annotations

import multiprocessing
import stat
from pathlib import Path

import pytest

from engine.kv.hashing import derive_tenant_salt
from kvtoll.dev_secret import FILE_NAME, dev_secret
from kvtoll.settings import load_settings


def test_dev_mode_makes_a_private_random_secret_once_per_data_directory(tmp_path: Path) -> None:
    first = load_settings(dev_mode=True, secret="", data_dir=str(tmp_path / "a"))
    secret = first.server_secret()
    assert secret != b"kvtoll-dev-secret" and len(secret) == 64
    path = tmp_path / "a" / FILE_NAME
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = load_settings(dev_mode=True, secret="", data_dir=str(tmp_path / "a"))
    assert again.server_secret() == secret  # a restart keeps sessions and salts
    other = load_settings(dev_mode=True, secret="", data_dir=str(tmp_path / "b"))
    assert other.server_secret() != secret
    # nobody can compute a tenant's salt from public knowledge any more
    assert derive_tenant_salt(secret, 1) != derive_tenant_salt(b"kvtoll-dev-secret", 1)
    assert load_settings(dev_mode=True, secret="set", data_dir=str(tmp_path)).server_secret() \
        == b"set"


def test_a_secret_file_others_can_read_is_refused(tmp_path: Path) -> None:
    dev_secret(tmp_path)
    (tmp_path / FILE_NAME).chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        dev_secret(tmp_path)


def test_outside_dev_mode_there_is_no_fallback(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="KVTOLL_SECRET is empty"):
        load_settings(dev_mode=False, secret="", data_dir=str(tmp_path)).server_secret()
    assert not (tmp_path / FILE_NAME).exists()


def _read(path: str, out: multiprocessing.Queue[bytes]) -> None:
    out.put(dev_secret(path))


def test_processes_starting_together_agree_on_one_secret(tmp_path: Path) -> None:
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    procs = [context.Process(target=_read, args=(str(tmp_path), out)) for _ in range(4)]
    for proc in procs:
        proc.start()
    secrets = {out.get(timeout=30) for _ in procs}
    for proc in procs:
        proc.join(30)
    assert len(secrets) == 1
    assert [p.name for p in tmp_path.iterdir()] == [FILE_NAME]  # nothing left aside


def test_worker_tokens_are_refused_empty_or_short_outside_dev_mode() -> None:
    with pytest.raises(ValueError, match="KVTOLL_WORKER_TOKEN is empty"):
        load_settings(dev_mode=False, worker_token="").worker_tokens()
    with pytest.raises(ValueError, match="16 characters"):
        load_settings(dev_mode=False, worker_token="x" * 15).worker_tokens()
    tokens = load_settings(dev_mode=False, worker_token="c" * 16,
                           worker_token_previous="p" * 16).worker_tokens()
    assert tokens.matches("c" * 16) and tokens.matches("p" * 16) and not tokens.matches("x")
    assert not load_settings(dev_mode=True, worker_token="").worker_tokens().enabled


def test_metrics_are_open_only_in_dev_mode_without_a_metrics_token() -> None:
    assert load_settings(dev_mode=True).metrics_open()
    assert not load_settings(dev_mode=True, metrics_token="m" * 20).metrics_open()
    assert not load_settings(dev_mode=False).metrics_open()
