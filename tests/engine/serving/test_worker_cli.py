"""``kvtoll worker``: bad flags are one line + exit 2; a real worker process serves."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
import torch
import typer
from typer.testing import CliRunner

from engine.cli import engine_config, register

TOKEN = "worker-cli-test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(autouse=True)
def worker_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker token and no dev mode, whatever the calling shell has."""
    for name in ("KVTOLL_WORKER_TOKEN_PREVIOUS", "KVTOLL_TLS_CERT", "KVTOLL_TLS_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KVTOLL_WORKER_TOKEN", TOKEN)
    monkeypatch.setenv("KVTOLL_DEV_MODE", "0")


def _app() -> typer.Typer:
    app = typer.Typer()
    register(app)

    @app.command("noop")
    def noop() -> None:  # a second command keeps "worker" a named subcommand
        """Nothing."""

    return app


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--dtype", "float16"], "dtype"),
        (["--model", "/nonexistent/model.gguf"], "model not found"),
        (["--port", "70000"], "--port"),
        (["--model", "kvtoll-tiny", "--block-size", "0"], "block_size"),
        (["--model", "kvtoll-tiny", "--num-blocks", "-1"], "num_kv_blocks"),
        (["--model", "kvtoll-tiny", "--kv-cache-mb", "0"], "--kv-cache-mb"),
        (["--model", "kvtoll-tiny", "--gpu-memory-utilization", "1.5"], "gpu_memory_utilization"),
        (["--model", "kvtoll-tiny", "--max-body-mb", "0"], "--max-body-mb"),
        (["--model", "kvtoll-tiny", "--host", "no-such-host.invalid"], "--host"),
        (["--model", "kvtoll-tiny", "--device", "tpu"], "use cpu, cuda or cuda:N"),
        (["--model", "kvtoll-tiny", "--cuda-graphs"], "--cuda-graphs needs a CUDA device"),
        (["--model", "kvtoll-tiny", "--linear-quant", "int4"], "--linear-quant must be one of"),
        (["--model", "kvtoll-tiny", "--kv-cache-dtype", "fp8"], "--kv-cache-dtype must be one of"),
    ],
)
def test_bad_flags_fail_with_one_line_and_exit_2(args: list[str], needle: str) -> None:
    result = CliRunner().invoke(_app(), ["worker", *args])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0]


@pytest.mark.parametrize(
    ("env", "args", "needle"),
    [
        ({"KVTOLL_WORKER_TOKEN": ""}, [], "KVTOLL_WORKER_TOKEN is empty"),
        ({"KVTOLL_WORKER_TOKEN": "short"}, [], "at least 16 characters"),
        ({}, ["--worker-token", ""], "KVTOLL_WORKER_TOKEN is empty"),
        ({}, ["--worker-token-previous", "short"], "at least 16 characters"),
        ({"KVTOLL_WORKER_TOKEN": ""}, ["--worker-token-previous", TOKEN], "needs a current one"),
        ({}, ["--tls-cert", "/nonexistent.pem"], "--tls-cert and --tls-key go together"),
        ({}, ["--tls-cert", "/nonexistent.pem", "--tls-key", "/x.pem"], "cannot read --tls-cert"),
    ],
)
def test_an_unsafe_token_or_bad_tls_files_fail_with_one_line(
    env: dict[str, str], args: list[str], needle: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    result = CliRunner().invoke(_app(), ["worker", "--model", "kvtoll-tiny", "--port", "0", *args])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0]


def test_cuda_graphs_need_the_triton_backend() -> None:
    with pytest.raises(ValueError, match="--cuda-graphs needs the triton attention backend"):
        engine_config(
            "kvtoll-tiny", None, attention_backend="torch", device="cuda", cuda_graphs=True
        )


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_cuda_device_without_a_gpu_fails_with_one_line() -> None:
    result = CliRunner().invoke(_app(), ["worker", "--model", "kvtoll-tiny", "--device", "cuda"])
    assert result.exit_code == 2, result.output
    assert result.output.strip() == "error: device 'cuda': no CUDA GPU is visible to this process"


def test_port_in_use_fails_before_loading(busy_port: int) -> None:
    result = CliRunner().invoke(
        _app(), ["worker", "--model", "kvtoll-tiny", "--port", str(busy_port)]
    )
    assert result.exit_code == 2
    assert "already in use" in result.output


SCRIPT = """
import typer, sys
from engine.cli import register
app = typer.Typer()
register(app)
@app.command("noop")
def noop() -> None: ...
app(sys.argv[1:])
"""


def test_worker_process_serves_and_stops_on_sigint() -> None:
    port = _free_port()
    cmd = [
        sys.executable,
        "-c",
        SCRIPT,
        "worker",
        "--model",
        "kvtoll-tiny",
        "--port",
        str(port),
        "--num-blocks",
        "32",
        "--served-model-name",
        "tiny",
    ]
    env = {**os.environ, "KVTOLL_LOG_LEVEL": "warning", "KVTOLL_WORKER_TOKEN": TOKEN}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            if proc.poll() is not None:
                break
            try:
                if httpx.get(f"{base}/healthz", headers=AUTH, timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        resp = httpx.post(f"{base}/v1/chat/completions", json=body, headers=AUTH, timeout=60)
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] <= 2
        assert httpx.get(f"{base}/load", headers=AUTH).json()["num_total_blocks"] == 32
        refused = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
        assert refused.status_code == 401 and TOKEN not in refused.text
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) in (0, 128 + signal.SIGINT, -signal.SIGINT)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--redis-url", "redis://x", "--host", "0.0.0.0"], "--advertise-url"),
        (["--redis-url", "redis://x", "--kv-events", "carrier-pigeon"], "--kv-events"),
        (["--redis-url", "redis://x", "--heartbeat-ttl", "0"], "--heartbeat-ttl"),
        (["--redis-url", "redis://x", "--advertise-url", "10.0.0.1:80"], "--advertise-url"),
    ],
)
def test_bad_registration_flags(args: list[str], needle: str) -> None:
    result = CliRunner().invoke(_app(), ["worker", "--model", "kvtoll-tiny", "--port", "0", *args])
    assert result.exit_code == 2, result.output
    assert needle in result.output and len(result.output.strip().splitlines()) == 1
