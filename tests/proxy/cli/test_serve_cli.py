"""``kvtoll serve``: every caller mistake is one line on stderr and exit code 2, before
any model is loaded; ``kvtoll bench`` lists the contributed subcommands."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtoll.cli.main import build_app


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in ("KVTOLL_REDIS_URL", "KVTOLL_MODEL_PATH", "KVTOLL_DATABASE_URL",
                 "KVTOLL_WORKER_TLS_CA", "KVTOLL_WORKER_DISCOVERY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KVTOLL_DATABASE_URL", f"sqlite:///{tmp_path / 'k.db'}")
    monkeypatch.setenv("KVTOLL_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("KVTOLL_ADMIN_TOKEN", "a-long-enough-admin-token-for-cli")
    monkeypatch.setenv("KVTOLL_SECRET", "cli-test-secret")
    monkeypatch.setenv("KVTOLL_DEV_MODE", "0")
    monkeypatch.setenv("KVTOLL_WORKER_TOKEN", "cli-test-worker-token-0123456")
    return tmp_path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _serve(*args: str) -> tuple[int, str]:
    """``kvtoll serve`` on a free port unless ``args`` name one (the default port 8000
    may be held by a real server on this machine, which would fail every case early)."""
    port = [] if "--port" in args else ["--port", str(_free_port())]
    result = CliRunner().invoke(build_app(), ["serve", *port, *args])
    return result.exit_code, result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--worker", "ftp://example.com"], "--worker must be an http(s) URL"),
        (["--worker", "not a url"], "--worker must be an http(s) URL"),
        (["--port", "70000"], "--port must be between 0 and 65535"),
    ],
)
def test_bad_flags(env: Path, args: list[str], message: str) -> None:
    code, output = _serve(*args)
    assert code == 2 and message in output
    assert not (env / "k.db").exists()  # nothing written


def test_weak_admin_token(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTOLL_ADMIN_TOKEN", "admin")
    code, output = _serve()
    assert code == 2 and "KVTOLL_ADMIN_TOKEN" in output


def test_missing_secret(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTOLL_SECRET", "")
    code, output = _serve()
    assert code == 2 and "KVTOLL_SECRET" in output


def test_port_in_use(env: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        code, output = _serve("--port", str(busy.getsockname()[1]))
    assert code == 2 and "already in use" in output


def test_no_reachable_worker(env: Path) -> None:
    """One unreachable worker among others starts down (tests/proxy/test_worker_lifecycle.py);
    with none reachable the models are unknown: one line, exit 2."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    code, output = _serve("--worker", f"http://127.0.0.1:{port}")
    assert code == 2 and "no worker could be reached" in output
    assert not (env / "k.db").exists()


def test_bench_group_lists_contributed_commands() -> None:
    result = CliRunner().invoke(build_app(), ["bench", "--help"])
    assert result.exit_code == 0
    assert "routing" in result.output


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("KVTOLL_DEVICE", "tpu", "device 'tpu': use cpu, cuda or cuda:N"),
        ("KVTOLL_CUDA_GRAPHS", "1", "--cuda-graphs needs a CUDA device"),
        ("KVTOLL_GPU_MEMORY_UTILIZATION", "0", "gpu_memory_utilization must be in (0, 1]"),
    ],
)
def test_bad_engine_device_settings(
    env: Path, monkeypatch: pytest.MonkeyPatch, name: str, value: str, message: str
) -> None:
    monkeypatch.setenv(name, value)
    code, output = _serve()
    assert code == 2 and message in output


@pytest.mark.parametrize(
    ("env_token", "args", "message"),
    [
        ("", [], "KVTOLL_WORKER_TOKEN is empty"),
        ("short", [], "at least 16 characters"),
        (None, ["--worker-token", ""], "KVTOLL_WORKER_TOKEN is empty"),
        (None, ["--worker-tls-ca", "/nonexistent/ca.pem"], "cannot read --worker-tls-ca"),
        (None, ["--worker-discovery"], "--worker-discovery needs KVTOLL_REDIS_URL"),
    ],
)
def test_worker_link_mistakes(
    env: Path, monkeypatch: pytest.MonkeyPatch, env_token: str | None, args: list[str],
    message: str,
) -> None:
    if env_token is not None:
        monkeypatch.setenv("KVTOLL_WORKER_TOKEN", env_token)
    code, output = _serve("--worker", "http://127.0.0.1:9", *args)
    assert code == 2 and message in output and len(output.strip().splitlines()) == 1
    assert not (env / "k.db").exists()


def test_discovery_needs_a_worker_list(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTOLL_REDIS_URL", "redis://127.0.0.1:1")
    code, output = _serve("--worker-discovery")
    assert code == 2 and "give at least one --worker" in output


def test_dev_mode_without_admin_token_gets_a_generated_one() -> None:
    from kvtoll.settings import load_settings
    from proxy.cli.serve import with_dev_admin_token

    dev, token = with_dev_admin_token(load_settings(dev_mode=True, admin_token=""))
    assert token is not None and len(token) >= 32
    assert dev.admin_token.get_secret_value() == token
    assert dev.admin_disabled_reason() is None and dev.admin_token_matches(token)
    _, again = with_dev_admin_token(load_settings(dev_mode=True, admin_token=""))
    assert again != token  # random per start
    chosen = load_settings(dev_mode=True, admin_token="mine")
    assert with_dev_admin_token(chosen) == (chosen, None)
    production = load_settings(dev_mode=False, admin_token="")
    assert with_dev_admin_token(production) == (production, None)  # refused later, as before


def test_a_dev_mode_start_that_fails_prints_only_the_error(env: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTOLL_DEV_MODE", "1")
    monkeypatch.setenv("KVTOLL_ADMIN_TOKEN", "")
    code, output = _serve("--worker", "not-a-url")
    assert code == 2 and output.startswith("error: ") and output.count("\n") == 1
    assert "admin token" not in output
