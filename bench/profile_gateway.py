"""Where ``kvtoll serve --worker`` spends its time: py-spy samples of the gateway process
(idle, then under a sequential client), as ``proxy_overhead.py`` starts it.

    pip install py-spy    # into the venv; then
    python bench/profile_gateway.py [--ledger-writer process|thread] [--requests 1500]
        [--concurrency 32 --load-seconds 12]

Prints the top entries by own samples, by inclusive samples and by inclusive samples
of the project's own frames (share of all samples of the process, every thread; with
``--gil`` only the thread holding the GIL) for the idle and the loaded window, and the added
latency's p50/p99/p99.9 over the same requests. With ``--concurrency N`` the load is a
closed loop of N keep-alive clients for the whole loaded window instead (throughput,
not added latency). Either way the gateway's user and system CPU milliseconds per
request over the loaded window are reported (``/proc``; the ledger writer process's
not included).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as ``python bench/<script>.py``: the repo root, for bench.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from bench import gateway_process as gp
from bench import latency_series
from bench import proxy_overhead as po
from bench.engine_servers import free_port

# a frame of the project's own code (the inclusive list is otherwise all stack roots)
PROJECT_FRAME = re.compile(r"\((proxy|kvtoll|billing|engine)/")


def top_entries(raw: Path, count: int) -> dict[str, Any]:
    """py-spy's raw (collapsed) stacks → the top frames by own and inclusive samples."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, num = line.rpartition(" ")
        if not num.isdigit():
            continue
        frames = stack.split(";")
        total += int(num)
        own[frames[-1]] += int(num)
        for frame in set(frames):
            inclusive[frame] += int(num)

    def share(counter: collections.Counter[str]) -> list[str]:
        return [f"{100 * n / total:.1f}% {frame}" for frame, n in counter.most_common(count)]

    project = collections.Counter({frame: n for frame, n in inclusive.items()
                                   if PROJECT_FRAME.search(frame)})
    return {"samples": total, "own": share(own) if total else [],
            "inclusive": share(inclusive) if total else [],
            "inclusive_project": share(project) if total else []}


def record(py_spy: str, pid: int, seconds: float, out: Path,
           gil: bool = False) -> subprocess.Popen[bytes]:
    """py-spy on ``pid``; with ``gil`` only the samples of the thread holding the GIL
    (the CPU the event loop and its helpers spend, without threads parked in a wait)."""
    return subprocess.Popen([py_spy, "record", "-p", str(pid), "-d", str(int(seconds)),
                             "-r", "200", "-f", "raw", "-o", str(out), *(["--gil"] if gil else [])],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run(args: argparse.Namespace) -> dict[str, Any]:
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        raise SystemExit("error: py-spy is not installed (pip install py-spy)")
    tmp = Path(tempfile.mkdtemp(prefix="kvtoll-profile-"))
    database_url = f"sqlite:///{tmp / 'kvtoll.db'}"
    key = gp.seed_database(database_url)
    up, gw = free_port(), free_port()
    direct, gateway = f"http://127.0.0.1:{up}", f"http://127.0.0.1:{gw}"
    procs = [po.spawn("--serve-upstream", "5", str(up))]
    try:
        gp.wait_ready(direct, procs[0])
        procs.append(gp.spawn_gateway(direct, database_url, str(tmp / "data"), gw,
                                      args.ledger_writer))
        gp.wait_ready(gateway, procs[1])
        pid = procs[1].pid
        record(py_spy, pid, args.idle_seconds, tmp / "idle.txt", args.gil).wait()
        headers = {"Authorization": f"Bearer {key}"}
        if args.concurrency:  # warm up first: the window measures the steady state
            latency_series.run_client(latency_series.closed_loop(gateway, headers, po.BODY, 4, 1.0))
        cpu_before = user_system_seconds(pid)
        spy = record(py_spy, pid, args.load_seconds, tmp / "load.txt", args.gil)
        if args.concurrency:
            load = closed_loop_load(gateway, headers, args.concurrency, args.load_seconds)
        else:
            load = sequential_load(direct, gateway, headers, args.requests, args.warmup)
        cpu_after = user_system_seconds(pid)
        spy.wait()
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)
    num = load.pop("num_requests")
    return {"ledger_writer": args.ledger_writer, "gil_only": args.gil,
            "concurrency": args.concurrency or 1, **load,
            "cpu_ms_per_request": {
                name: round((after - before) * 1000 / max(1, num), 3)
                for name, before, after in zip(("user", "system"), cpu_before, cpu_after,
                                               strict=True)},
            "idle": top_entries(tmp / "idle.txt", args.top),
            "load": top_entries(tmp / "load.txt", args.top)}


def user_system_seconds(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of process ``pid`` (all its threads; ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def sequential_load(direct: str, gateway: str, headers: dict[str, str], requests: int,
                    warmup: int) -> dict[str, Any]:
    """Direct and gateway calls in turn on one keep-alive client: the added latency."""
    added: list[float] = []
    with httpx.Client(timeout=30) as client:
        for _ in range(requests):
            t0 = time.perf_counter()
            client.post(direct + "/v1/chat/completions", json=po.BODY)
            t1 = time.perf_counter()
            response = client.post(gateway + "/v1/chat/completions", json=po.BODY,
                                   headers=headers)
            t2 = time.perf_counter()
            if response.status_code != 200:
                raise RuntimeError(f"{response.status_code} {response.text}")
            added.append(((t2 - t1) - (t1 - t0)) * 1000)
    measured = added[warmup:]
    return {"num_requests": len(added), "requests": len(measured),
            "added": latency_series.tail(measured)}


def closed_loop_load(gateway: str, headers: dict[str, str], concurrency: int,
                     seconds: float) -> dict[str, Any]:
    """``concurrency`` keep-alive clients in a closed loop for ``seconds``."""
    result = latency_series.run_client(latency_series.closed_loop(
        gateway, headers, po.BODY, concurrency, seconds))
    done = len(result.latencies_ms)
    return {"num_requests": done, "errors": result.errors,
            "requests_per_s": round(done / result.elapsed_s, 1),
            "latency": latency_series.tail(result.latencies_ms) if done else {}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ledger-writer", choices=["process", "thread"], default="process")
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--idle-seconds", type=float, default=4)
    parser.add_argument("--load-seconds", type=float, default=12)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--concurrency", type=int, default=0,
                        help="load with this many closed-loop clients (default: the "
                             "sequential paired client)")
    parser.add_argument("--gil", action="store_true",
                        help="sample only the thread holding the GIL (py-spy --gil): where "
                             "the CPU goes, without the threads parked in a wait")
    print(json.dumps(run(parser.parse_args()), indent=2))


if __name__ == "__main__":
    main()
