"""``kvtoll serve`` as an operator runs it, in a subprocess, with the official SDK:
in front of a ``kvtoll worker`` (tiny model) with ``--worker``, and on the embedded
defaults with the real bundled SmolLM2-135M-Instruct (the README's first command)."""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from sqlalchemy.orm import Session, sessionmaker

from billing.db import make_engine, session_factory
from billing.migrate import upgrade
from billing.models import UsageRecord
from tests.proxy.helpers import Tenants, free_port, seed, settled_rows, wait_until

SYSTEM = "You are a careful assistant for the kvtoll end-to-end tests. " * 3


def _kvtoll(*args: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    code = "from kvtoll.cli.main import main; main()"
    return subprocess.Popen([sys.executable, "-c", code, *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _wait_healthy(port: int, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode}: {proc.stderr.read().decode()[-2000:]}"
                                 if proc.stderr else "exited")
        try:
            return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, f"server on port {port}", timeout_s)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    root = Path(__file__).resolve().parents[2]
    return {**os.environ, "PYTHONPATH": str(root), "KVTOLL_DEV_MODE": "1",
            "KVTOLL_DATABASE_URL": f"sqlite:///{tmp_path / 'kvtoll.db'}",
            "KVTOLL_DATA_DIR": str(tmp_path / "data"), "KVTOLL_REDIS_URL": "",
            "KVTOLL_ADMIN_TOKEN": "", "KVTOLL_SECRET": ""}


@pytest.fixture
def billing_db(env: dict[str, str]) -> Iterator[sessionmaker[Session]]:
    upgrade(env["KVTOLL_DATABASE_URL"])
    engine = make_engine(env["KVTOLL_DATABASE_URL"])
    yield session_factory(engine)
    engine.dispose()


def _ask(client: openai.OpenAI, model: str, user: str = "Name a colour.") -> tuple[str, int]:
    out = client.chat.completions.create(
        model=model, max_tokens=8, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
    )
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    return out.choices[0].message.content or "", out.usage.prompt_tokens_details.cached_tokens or 0


def _check_prefix_cache_and_isolation(port: int, model: str, tenants: Tenants) -> openai.OpenAI:
    a = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=tenants.key_a,
                      max_retries=0, timeout=120)
    b = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=tenants.key_b,
                      max_retries=0, timeout=120)
    assert [m.id for m in a.models.list()] == [model]
    assert _ask(a, model)[1] == 0
    assert _ask(b, model)[1] == 0  # same prompt, other tenant: no hit
    text, cached = _ask(a, model)
    assert cached > 0 and text
    return a


def _check_hits_billed_cheaper(rows: list[UsageRecord], expected: int) -> None:
    """The ``expected`` prefix hits (found by content: rows of one ledger batch are
    inserted in request id order, not arrival order) were billed below list price."""
    hits = [r for r in rows if r.cached_tokens > 0]
    assert len(hits) == expected and all(h.billed_pico < h.list_pico for h in hits)


def _check_dev_admin_token(port: int, proc: subprocess.Popen[bytes]) -> None:
    """Dev mode without KVTOLL_ADMIN_TOKEN: the token printed at start opens the admin
    dashboard (it was printed before the server answered, so it is in the pipe)."""
    assert proc.stderr is not None
    fd, seen = proc.stderr.fileno(), b""  # raw reads: select cannot see a file's buffer
    while not re.search(rb"/admin/\.\.\.: (\S+) ", seen):
        ready, _, _ = select.select([fd], [], [], 10)
        assert ready, f"no admin token line in {seen[-2000:]!r}"
        seen += os.read(fd, 65536)
    match = re.search(rb"/admin/\.\.\.: (\S+) ", seen)
    assert match is not None
    token = match.group(1).decode()
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
        signed = client.post("/admin/dashboard/login", data={"admin_token": token},
                             follow_redirects=True)
        assert signed.status_code == 200 and 'id="tenants"' in signed.text
        assert client.get("/").status_code == 200


def test_serve_in_front_of_a_worker(
    env: dict[str, str], billing_db: sessionmaker[Session]
) -> None:
    tenants = seed(billing_db, model="kvtoll-tiny")
    worker_port, proxy_port = free_port(), free_port()
    worker = _kvtoll("worker", "--model", "kvtoll-tiny", "--port", str(worker_port),
                     "--num-blocks", "96", "--max-model-len", "512", env=env)
    try:
        _wait_healthy(worker_port, worker, 120)
        proxy = _kvtoll("serve", "--port", str(proxy_port), "--no-semantic-cache", "--worker",
                        f"http://127.0.0.1:{worker_port}", env=env)
        try:
            _wait_healthy(proxy_port, proxy, 120)
            _check_dev_admin_token(proxy_port, proxy)
            client = _check_prefix_cache_and_isolation(proxy_port, "kvtoll-tiny", tenants)
            # streamed: the worker's first-chunk counts make the header say so up front
            with client.chat.completions.with_streaming_response.create(
                model="kvtoll-tiny", max_tokens=8, temperature=0, stream=True,
                messages=[{"role": "system", "content": SYSTEM},
                          {"role": "user", "content": "Name a colour."}],
            ) as streamed:
                assert streamed.headers["x-kvtoll-cache"] == "prefix"
                assert list(streamed.iter_lines())
        finally:
            _stop(proxy)
    finally:
        _stop(worker)
    rows = settled_rows(billing_db, 4)
    assert {r.worker for r in rows} == {f"http://127.0.0.1:{worker_port}"}
    _check_hits_billed_cheaper(rows, 2)


@pytest.mark.slow
def test_readme_serve_command_with_the_real_model(
    env: dict[str, str], billing_db: sessionmaker[Session]
) -> None:
    from engine.loader.bundled import bundled_model_path

    model = bundled_model_path().stem  # the served name: the GGUF file's stem
    tenants = seed(billing_db, model=model)
    port = free_port()
    proxy = _kvtoll("serve", "--port", str(port), env=env)
    try:
        _wait_healthy(port, proxy, 300)
        client = _check_prefix_cache_and_isolation(port, model, tenants)
        # another question under the same system prompt: a prefix hit, not a semantic one
        raw = client.chat.completions.with_raw_response.create(
            model=model, max_tokens=8, temperature=0,
            messages=[{"role": "system", "content": SYSTEM},
                      {"role": "user", "content": "Which planet is largest?"}],
        )
        assert raw.headers["x-kvtoll-cache"] == "prefix"
    finally:
        _stop(proxy)
    rows = settled_rows(billing_db, 4)
    _check_hits_billed_cheaper(rows, 2)
