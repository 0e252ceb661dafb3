"""Do two workers started with ``--dtype auto`` on one machine always pick one dtype?

Each trial starts two ``kvtoll worker --dtype auto`` processes at the same moment and
reads the dtype each names twice: in its start-up line (``kvtoll worker: MODEL (DTYPE)
on ...``) and in ``GET /v1/models`` (``data[i].kvtoll.dtype``); the trial agrees when
all four say the same. By default every trial gets a fresh ``XDG_CACHE_HOME``, so no
persisted probe result exists and the two workers race to measure it (the probe's
file lock is what makes them agree); ``--keep-probe`` shares one cache directory over
all trials instead (the steady state of a machine). The built native kernels and the
dequantized weights (``kvtoll/kernels``, ``kvtoll/weights``) are shared by every trial
through links to the machine's own (``$XDG_CACHE_HOME``, else ``~/.cache``), so only
the probe file is new and a trial costs two starts, not a C++ build and a GGUF
dequantization each. Prints one JSON object: each
trial's four readings and ``agreed`` as "N/TRIALS".

    .venv/bin/python bench/dtype_agreement.py --trials 10
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

LINE = re.compile(r"kvtoll worker: (?P<model>.+) \((?P<dtype>\w+)\) on http://")
TOKEN = "dtype-agreement-worker-token-0123456789"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start(model: str | None, port: int, cache_home: Path, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-c", "from kvtoll.cli.main import main; main()",
           "worker", "--dtype", "auto",
           "--port", str(port), "--num-blocks", "64", "--worker-token", TOKEN]
    if model:
        cmd += ["--model", model]
    env = {**os.environ, "XDG_CACHE_HOME": str(cache_home)}
    with log.open("wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)


def _wait_line(log: Path, proc: subprocess.Popen[bytes], timeout_s: float) -> str | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        match = LINE.search(log.read_text(errors="replace"))
        if match:
            return match.group("dtype")
        if proc.poll() is not None:
            return None
        time.sleep(0.2)
    return None


def _listed_dtype(port: int, timeout_s: float) -> str | None:
    deadline = time.monotonic() + timeout_s
    headers = {"Authorization": f"Bearer {TOKEN}"}
    while time.monotonic() < deadline:
        try:
            body = httpx.get(f"http://127.0.0.1:{port}/v1/models", headers=headers,
                             timeout=5).json()
            return str(body["data"][0]["kvtoll"]["dtype"])
        except (httpx.HTTPError, KeyError, IndexError, ValueError):
            time.sleep(0.3)
    return None


SHARED_CACHES = ("kernels", "weights")


def machine_cache() -> Path:
    """The machine's own cache directory (``$XDG_CACHE_HOME``, else ``~/.cache``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


def fresh_cache_home(cache_home: Path, shared: Path) -> None:
    """``cache_home/kvtoll`` with the shared build and weight caches linked in."""
    (cache_home / "kvtoll").mkdir(parents=True, exist_ok=True)
    for name in SHARED_CACHES:
        (shared / "kvtoll" / name).mkdir(parents=True, exist_ok=True)
        link = cache_home / "kvtoll" / name
        if not link.exists():
            link.symlink_to(shared / "kvtoll" / name, target_is_directory=True)


def trial(model: str | None, cache_home: Path, workdir: Path, timeout_s: float) -> dict[str, Any]:
    ports = [_free_port(), _free_port()]
    logs = [workdir / f"worker{i}.log" for i in range(2)]
    procs = [_start(model, p, cache_home, log) for p, log in zip(ports, logs, strict=True)]
    try:
        lines = [_wait_line(log, p, timeout_s) for log, p in zip(logs, procs, strict=True)]
        listed = [_listed_dtype(port, 30) for port in ports]
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    readings = lines + listed
    return {"log_line": lines, "v1_models": listed,
            "agree": None not in readings and len(set(readings)) == 1}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--model", default=None, help="model path or kvtoll-tiny (default: bundled)")
    ap.add_argument("--keep-probe", action="store_true",
                    help="one XDG_CACHE_HOME for all trials (default: a fresh one per trial)")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for a start")
    args = ap.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="kvtoll-dtype-") as tmp:
        root = Path(tmp)
        shared = machine_cache()
        for i in range(args.trials):
            cache_home = root / ("cache" if args.keep_probe else f"cache{i}")
            fresh_cache_home(cache_home, shared)
            workdir = root / f"trial{i}"
            workdir.mkdir()
            results.append(trial(args.model, cache_home, workdir, args.timeout))
            print(json.dumps({"trial": i, **results[-1]}), file=sys.stderr, flush=True)
    agreed = sum(r["agree"] for r in results)
    print(json.dumps({
        "trials": results,
        "agreed": f"{agreed}/{len(results)}",
        "dtypes_seen": sorted({d for r in results for d in r["log_line"] + r["v1_models"] if d}),
        "fresh_probe_each_trial": not args.keep_probe,
    }, indent=2))


if __name__ == "__main__":
    main()
