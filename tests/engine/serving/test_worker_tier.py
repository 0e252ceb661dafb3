"""``kvtoll worker --kv-tier-mb N --kv-shared redis|peer|off``: flag checks (one line,
exit 2) and the tier's ``/metrics`` on a real worker app."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import httpx
import pytest
import typer
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from engine.async_engine import AsyncEngine
from engine.cli import register, tier_config
from engine.config import EngineConfig
from engine.factory import LoadedModel, build_llm_engine
from engine.kv.tier.config import TierConfig
from engine.serving.app import build_worker_app
from engine.serving.server import tier_metrics
from kvtoll.settings import Settings


@pytest.fixture(autouse=True)
def worker_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTOLL_WORKER_TOKEN", "worker-cli-test-token-0123456789")
    monkeypatch.setenv("KVTOLL_DEV_MODE", "0")
    monkeypatch.delenv("KVTOLL_REDIS_URL", raising=False)


def _app() -> typer.Typer:
    app = typer.Typer()
    register(app)

    @app.command("noop")
    def noop() -> None:
        """Nothing."""

    return app


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--kv-tier-mb", "-1"], "--kv-tier-mb must be in 0.."),
        (["--kv-tier-mb", "8", "--kv-shared", "disk"], "--kv-shared must be redis, peer or off"),
        (["--kv-tier-mb", "8", "--kv-shared", "redis"], "needs KVTOLL_REDIS_URL"),
        (["--kv-shared", "redis"], "--kv-shared needs a host tier"),
    ],
)
def test_bad_tier_flags_fail_with_one_line_and_exit_2(args: list[str], needle: str) -> None:
    result = CliRunner().invoke(_app(), ["worker", "--model", "kvtoll-tiny", "--port", "0", *args])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0]


def test_tier_flags_build_the_tier_config() -> None:
    settings = Settings(kv_tier_mode="int8", kv_tier_ttl_s=60)
    assert tier_config(settings, 0, "off", None) is None
    tc = tier_config(settings, 8, "redis", "redis://127.0.0.1:6379/0")
    assert tc is not None and tc.host_bytes == 8 << 20 and tc.shared == "redis"
    assert tc.mode.value == "int8" and tc.ttl_s == 60
    with pytest.raises(ValueError, match="KVTOLL_KV_TIER_MODE"):
        tier_config(Settings(kv_tier_mode="zstd"), 8, "off", None)


def test_metrics_show_each_tier(tiny_model: LoadedModel) -> None:
    from engine.api import GenerationRequest, SamplingParams

    llm = build_llm_engine(
        EngineConfig.tiny(num_kv_blocks=10, kv_tier=TierConfig(host_bytes=1 << 20)), tiny_model
    )
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompts = [list(range(1, 100)), list(range(100, 220)), list(range(1, 100))]
    for i, prompt in enumerate(prompts):
        llm.generate_sync([GenerationRequest(f"r{i}", tuple(prompt), sp)])
        assert llm.tier is not None
        llm.tier.writer.drain()
    engine = AsyncEngine(llm)
    app = build_worker_app(engine, metrics=tier_metrics(engine))
    text = TestClient(app).get("/metrics").text
    values = dict(line.rsplit(" ", 1) for line in text.splitlines())
    assert float(values['kvtoll_kv_tier_bytes{tier="host"}']) > 0
    assert float(values['kvtoll_kv_tier_hits_total{tier="host"}']) > 0
    assert float(values["kvtoll_kv_tier_loads_total"]) > 0
    assert float(values["kvtoll_kv_tier_load_seconds_total"]) > 0
    engine.shutdown()


SCRIPT = """
import typer, sys
from engine.cli import register
app = typer.Typer()
register(app)
@app.command("noop")
def noop() -> None: ...
app(sys.argv[1:])
"""
TOKEN = "worker-cli-test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_worker(redis_url: str) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    cmd = [sys.executable, "-c", SCRIPT, "worker", "--model", "kvtoll-tiny", "--port", str(port),
           "--num-blocks", "32", "--kv-tier-mb", "8", "--kv-shared", "redis"]  # fmt: skip
    env = {**os.environ, "KVTOLL_LOG_LEVEL": "warning", "KVTOLL_WORKER_TOKEN": TOKEN,
           "KVTOLL_REDIS_URL": redis_url, "KVTOLL_DEV_MODE": "0"}  # fmt: skip
    env.pop("KVTOLL_WORKER_TOKEN_PREVIOUS", None)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            break
        try:
            if httpx.get(f"{base}/healthz", headers=AUTH, timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.1)
    assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
    return proc, base


def _metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", headers=AUTH).text
    values = dict(line.rsplit(" ", 1) for line in text.splitlines())
    return float(values[name])


@pytest.mark.redis
def test_a_worker_process_loads_the_prefix_another_worker_process_computed(
    redis_url: str,
) -> None:
    text = f"{uuid.uuid4().hex} " * 4
    salt = os.urandom(16).hex()  # a tenant no earlier run stored blocks for
    body = {"model": "kvtoll-tiny", "messages": [{"role": "user", "content": text}],
            "max_tokens": 2, "temperature": 0, "cache_salt": salt}  # fmt: skip
    workers = [_start_worker(redis_url) for _ in range(2)]
    try:
        (_, a), (_, b) = workers
        first = httpx.post(f"{a}/v1/chat/completions", json=body, headers=AUTH, timeout=60)
        assert first.status_code == 200
        assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        for _ in range(100):  # A writes behind: wait until its blocks are in Redis
            if _metric(a, 'kvtoll_kv_tier_stores_total{tier="shared"}') >= 8:
                break
            time.sleep(0.1)
        resp = httpx.post(f"{b}/v1/chat/completions", json=body, headers=AUTH, timeout=60)
        cached = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 16 * 8
        assert resp.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
        assert _metric(b, "kvtoll_kv_tier_prefetched_total") * 16 == cached
        details = resp.json()["usage"]["prompt_tokens_details"]
        assert details["kvtoll_tier_cached_tokens"] == {"host": 0, "shared": cached}
        assert httpx.get(f"{b}/metrics").status_code == 401
    finally:
        for proc, _ in workers:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=30)
