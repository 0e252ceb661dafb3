"""Live: three ``kvtoll worker`` processes (tiny model) behind ``kvtoll serve``.

Requests sharing a long prefix land on the worker that holds it (``x-kvtoll-worker``,
``cached_tokens``) while unrelated traffic spreads; after a worker is killed, no
request that had not begun streaming is lost. Prompts are text and chat messages:
the gateway loads the workers' tokenizer (``kvtoll-tiny``: the byte tokenizer) and
hashes the same token ids the workers cache; token-id prompts route the same way.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.tokenizer import ByteTokenizer
from tests.proxy.helpers import free_port

KVTOLL = Path(sys.executable).with_name("kvtoll")
ADMIN = "live-routing-admin-token-0123456789"
MODEL = "kvtoll-tiny"
BLOCK = 16  # the workers' KV block size

# Four processes start (about a minute on two shared cores). The console script comes
# with the README's install (beside this interpreter); its absence is a failure.
pytestmark = pytest.mark.slow


def _wait(check: Callable[[], bool], proc: subprocess.Popen[bytes], what: str) -> None:
    for _ in range(600):
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited with {proc.returncode}")
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{what} did not come up")


def _healthy(url: str) -> Callable[[], bool]:
    return lambda: httpx.get(f"{url}/healthz", timeout=1).is_success


def _start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    out = log.open("wb")
    return subprocess.Popen([str(KVTOLL), *args], env=env, stdout=out, stderr=subprocess.STDOUT)


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[str, list[tuple[str, subprocess.Popen[bytes]]]]]:
    env = {
        **os.environ,
        "KVTOLL_DEV_MODE": "1",
        "KVTOLL_ADMIN_TOKEN": ADMIN,
        "KVTOLL_SECRET": "live-routing-secret",
        "KVTOLL_DATA_DIR": str(tmp_path / "data"),
        "KVTOLL_DATABASE_URL": f"sqlite:///{tmp_path / 'kvtoll.db'}",
    }
    env.pop("KVTOLL_REDIS_URL", None)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        workers = []
        for i in range(3):
            port = free_port()
            # 16 MiB of KV (32,768 tokens), not the 1 GiB default: zeroing that took each
            # worker up to 2 s of CPU at start
            args = ["worker", "--model", MODEL, "--port", str(port), "--kv-cache-mb", "16"]
            proc = _start(args, env, tmp_path / f"worker{i}.log")
            procs.append(proc)
            workers.append((f"http://127.0.0.1:{port}", proc))
        for url, proc in workers:
            _wait(_healthy(url), proc, url)
        port = free_port()
        worker_args = [a for url, _ in workers for a in ("--worker", url)]
        gateway = _start(
            ["serve", "--port", str(port), "--no-semantic-cache", *worker_args],
            env,
            tmp_path / "serve.log",
        )
        procs.append(gateway)
        base = f"http://127.0.0.1:{port}"
        _wait(_healthy(base), gateway, "serve")
        yield base, workers
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


def _api_key(base: str) -> str:
    admin = {"Authorization": f"Bearer {ADMIN}"}
    httpx.post(f"{base}/admin/tenants", json={"name": "acme"}, headers=admin).raise_for_status()
    price = {
        "model": MODEL,
        "input": "1",
        "cached_input": "0.5",
        "output": "2",
        "semantic_fraction": "0.1",
    }
    httpx.post(f"{base}/admin/prices", json=price, headers=admin).raise_for_status()
    key = httpx.post(f"{base}/admin/tenants/acme/keys", json={"name": "k"}, headers=admin)
    key.raise_for_status()
    return str(key.json()["key"])


def _post(base: str, key: str, path: str, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    response = httpx.post(
        f"{base}{path}", json={"model": MODEL, "max_tokens": 2, **body}, timeout=60,
        headers={"Authorization": f"Bearer {key}"},
    )
    assert response.status_code == 200, response.text
    return response.headers["x-kvtoll-worker"], response.json()["usage"]


def _complete(base: str, key: str, prompt: list[int] | str) -> tuple[str, dict[str, Any]]:
    return _post(base, key, "/v1/completions", {"prompt": prompt})


def _chat(base: str, key: str, system: str, user: str) -> tuple[str, dict[str, Any]]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return _post(base, key, "/v1/chat/completions", {"messages": messages})


def _shared_blocks_tokens(a: list[int], b: list[int]) -> int:
    """Tokens in the full blocks two prompts share (what a prefix hit can reuse)."""
    common = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
    return min(common, len(b) - 1) // BLOCK * BLOCK


def _chat_ids(system: str, user: str) -> list[int]:
    messages: list[dict[str, object]] = [
        {"role": "system", "content": system}, {"role": "user", "content": user}]
    return ByteTokenizer().apply_chat_template(messages)


def _cached(usage: dict[str, Any]) -> int:
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))


def test_shared_prefix_lands_on_its_holder_and_a_killed_worker_loses_nothing(
    fleet: tuple[str, list[tuple[str, subprocess.Popen[bytes]]]],
) -> None:
    base, workers = fleet
    key = _api_key(base)
    spread: Counter[str] = Counter()
    for i in range(4):
        spread[_complete(base, key, [10 + i] * 40)[0]] += 1
    prefix = " ".join(f"clause {i} of the shared preamble;" for i in range(8))  # ~230 bytes
    byte_ids = ByteTokenizer().encode
    holder, _ = _complete(base, key, prefix + " first")
    sent = [byte_ids(prefix + " first", True)]  # what the holder has cached
    time.sleep(1.0)  # the router polls KV events every 0.1 s
    for i in range(3):
        text = f"{prefix} question {i}"
        worker, usage = _complete(base, key, text)
        assert worker == holder
        expected = max(_shared_blocks_tokens(p, byte_ids(text, True)) for p in sent)
        assert expected >= 12 * BLOCK and _cached(usage) == expected
        sent.append(byte_ids(text, True))
        spread[_complete(base, key, f"unrelated prompt number {i} " * (2 + i))[0]] += 1
    assert len(spread) >= 2  # unrelated traffic is not piled on one worker

    system = "You are the support assistant of a company. " * 6  # a long shared system prompt
    chat_holder, _ = _chat(base, key, system, "hello")
    sent = [_chat_ids(system, "hello")]
    time.sleep(1.0)
    for user in ("what are your hours?", "where is my order?"):
        worker, usage = _chat(base, key, system, user)
        assert worker == chat_holder
        expected = max(_shared_blocks_tokens(p, _chat_ids(system, user)) for p in sent)
        assert expected >= 16 * BLOCK and _cached(usage) == expected
        sent.append(_chat_ids(system, user))

    victim_url, victim = next((u, p) for u, p in workers if u == holder)
    victim.kill()
    victim.wait(timeout=10)
    for i in range(4):  # none of these had begun: each must be answered elsewhere
        worker, _ = _complete(base, key, f"{prefix} after the kill {i}")
        assert worker != victim_url
