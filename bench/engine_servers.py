"""The OpenAI-compatible servers :mod:`bench.engine_throughput` measures from outside,
each started as its own process on a free port and stopped before the next starts:

* ``kvtoll``: ``kvtoll worker`` on the bundled SmolLM2 GGUF (this checkout's code);
* ``vllm``: vLLM's OpenAI API server from the virtual environment ``bench/install_peers.sh``
  makes (``.bench-peers/vllm``), on the Hugging Face copy of the same GGUF that the
  script converts (``.bench-peers/smollm2-hf``), as the issue says it serves here:
  ``VLLM_CPU_KVCACHE_SPACE`` GiB of KV cache, OpenMP threads bound to cores 0-1,
  compile caches kept under ``.bench-peers/vllm-cache`` (its first start compiles
  the model with torch inductor for minutes; later starts reuse it).

Both get the same KV budget (:data:`KV_CACHE_GIB`), dtype and context length.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.engine_http import Endpoint

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / ".bench-peers"
VLLM_VENV = PEERS / "vllm"
VLLM_MODEL = PEERS / "smollm2-hf"
VLLM_CACHE = PEERS / "vllm-cache"
KV_CACHE_GIB = 2
MAX_MODEL_LEN = 2048
READY_TIMEOUT_S = 1500.0  # vLLM's first start compiles the model
WORKER_TOKEN = "bench-engine-throughput"
MODEL_NAME = "smollm2"


@dataclass(frozen=True)
class ServerSpec:
    name: str
    command: list[str]
    env: dict[str, str]
    endpoint: Endpoint
    log: Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _base_env() -> dict[str, str]:
    env = dict(os.environ)
    for name in ("KVTOLL_REDIS_URL", "KVTOLL_DATABASE_URL"):
        env.pop(name, None)  # a bench worker announces itself nowhere
    return env


def kvtoll_spec(
    dtype: str,
    log_dir: Path,
    linear_quant: str = "none",
    model: str | None = None,
    max_model_len: int = MAX_MODEL_LEN,
    checkout: Path | None = None,
    kv_cache_dtype: str = "auto",
    max_batched_tokens: int | None = None,
) -> ServerSpec:
    """``kvtoll worker`` (on the bundled model unless ``model``); ``linear_quant="int8"``
    and ``kv_cache_dtype="int8"``: its labelled quantized paths; ``checkout``: another
    checkout's worker, from its own ``.venv`` (e.g. the main branch, for a before/after
    in one run); ``max_batched_tokens``: its step token budget (default: the worker's
    own default, as vLLM runs on its own)."""
    port = free_port()
    root = checkout or ROOT
    bin_dir = root / ".venv" / "bin" if checkout else Path(sys.executable).parent
    cmd = [
        str(bin_dir / "kvtoll"), "worker", "--port", str(port),
        "--dtype", dtype, "--max-model-len", str(max_model_len),
        "--kv-cache-mb", str(KV_CACHE_GIB * 1024), "--max-num-seqs", "64",
        "--served-model-name", MODEL_NAME,
        "--worker-token", WORKER_TOKEN, "--linear-quant", linear_quant,
    ] + (["--model", model] if model else []) + (
        ["--kv-cache-dtype", kv_cache_dtype] if kv_cache_dtype != "auto" else [])  # fmt: skip
    if max_batched_tokens:
        cmd += ["--max-batched-tokens", str(max_batched_tokens)]
    env = _base_env()
    env["PYTHONPATH"] = str(root)
    endpoint = Endpoint(f"http://127.0.0.1:{port}/v1", MODEL_NAME, WORKER_TOKEN)
    name = "kvtoll" if linear_quant == "none" else f"kvtoll-{linear_quant}"
    name += "-kvint8" if kv_cache_dtype == "int8" else ""
    name += f"@{root.name}" if checkout else ""
    name += f":{max_batched_tokens}" if max_batched_tokens else ""
    return ServerSpec(name, cmd, env, endpoint, log_dir / f"{name}-worker.log")


def vllm_available() -> str | None:
    """Why the vLLM peer cannot run here, or None if it can."""
    if not (VLLM_VENV / "lib" / "python3.11" / "site-packages" / "vllm").is_dir():
        return f"no vLLM in {VLLM_VENV} (run bench/install_peers.sh)"
    if not (VLLM_MODEL / "config.json").exists():
        return f"no converted model in {VLLM_MODEL} (run bench/install_peers.sh)"
    return None


def vllm_spec(dtype: str, log_dir: Path, cpus: str) -> ServerSpec:
    port = free_port()
    cmd = [
        # not the `vllm` script: it reads the version of a distribution named "vllm",
        # and this one is "vllm-cpu" (PackageNotFoundError); the module does not
        str(VLLM_VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(VLLM_MODEL), "--port", str(port),
        "--host", "127.0.0.1", "--dtype", dtype, "--max-model-len", str(MAX_MODEL_LEN),
        "--served-model-name", MODEL_NAME,
    ]  # fmt: skip
    env = _base_env()
    env.pop("PYTHONPATH", None)
    env.update(
        VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB),
        VLLM_CPU_OMP_THREADS_BIND=cpus,
        VLLM_CACHE_ROOT=str(VLLM_CACHE / "vllm"),
        TORCHINDUCTOR_CACHE_DIR=str(VLLM_CACHE / "inductor"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    endpoint = Endpoint(f"http://127.0.0.1:{port}/v1", MODEL_NAME)
    return ServerSpec("vllm", cmd, env, endpoint, log_dir / "vllm-server.log")


def _wait_ready(spec: ServerSpec, proc: subprocess.Popen[bytes]) -> float:
    start = time.perf_counter()
    url = f"{spec.endpoint.base_url}/models"
    while time.perf_counter() - start < READY_TIMEOUT_S:
        if proc.poll() is not None:
            tail = spec.log.read_text(errors="replace")[-1500:]
            raise RuntimeError(f"{spec.name} exited {proc.returncode} before serving:\n{tail}")
        try:
            if httpx.get(url, headers=spec.endpoint.headers(), timeout=2.0).status_code == 200:
                return time.perf_counter() - start
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"{spec.name} not serving after {READY_TIMEOUT_S:.0f} s (log: {spec.log})")


@contextmanager
def serving(spec: ServerSpec) -> Iterator[float]:
    """Run the server for the body; yields its start-up seconds; stops it after."""
    spec.log.parent.mkdir(parents=True, exist_ok=True)
    with spec.log.open("wb") as log:
        proc = subprocess.Popen(
            spec.command, env=spec.env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            yield _wait_ready(spec, proc)
        finally:
            _stop(proc)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's own process group (vLLM runs its engine in children),
    SIGKILL after a minute."""
    for sig, wait_s in ((signal.SIGTERM, 60.0), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            time.sleep(2.0)  # children leave after their parent
            return
        except subprocess.TimeoutExpired:
            continue
