"""Chaos run: the real gateway (``kvtoll serve`` in its own process) against real
PostgreSQL and Redis and two streaming workers (:mod:`bench.chaos_worker`), each
reached through a loopback TCP proxy this script controls (:mod:`bench.tcp_proxy`).

For each fault: a steady streamed load through the OpenAI SDK (``--clients``
threads), ``--phase-s`` seconds of normal traffic, the fault for ``--fault-s``
seconds, healed, ``--phase-s`` more; then the ledger is reconciled with what the
clients received. Faults::

    db_refused  db_blackholed  redis_refused  redis_blackholed
    worker_killed  worker_blackholed  gateway_sigkill  start_worker_down  outbox_disk_full

Per fault one JSON line: requests answered OK, errors by status (``cut``: a 200
stream that ended with an error event or a broken connection; ``client_timeout``: no
answer within 30 s, a hang), the longest request
during the fault and the bound it must stay under (the gateway's worker timeout +
1 s + the longest normal request), seconds until ``/readyz`` noticed (503, or the
worker marked down) and what it named, and ledger rows vs OK requests vs tokens:
``lost`` (an OK request without its row), ``doubled`` (rows per request id beyond
one), ``w1_used_after_heal_s`` (seconds from the heal until worker w1 answered a
request again; ``start_worker_down`` restarts the gateway while w1 is unreachable),
``ok_token_diff`` (billed - delivered over OK requests: must be 0) and, for cut
streams, ``cut_token_gap_max`` (delivered - billed, at most one journal interval).
A table follows. ``--fast`` runs one fault of each kind with a short load (CI:
``tests/bench/test_chaos.py``). ``outbox_disk_full`` needs a tmpfs mount (root);
it is reported as skipped otherwise.

    python -m bench.chaos [--fast] [--faults a,b] [--clients 4] [--phase-s 2] [--fault-s 4]

Needs ``KVTOLL_TEST_DATABASE_URL`` (a server where it may create a database) and
``KVTOLL_TEST_REDIS_URL``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from bench.chaos_env import JOURNAL_TOKENS, NUM_WORDS, WORKER_READ_TIMEOUT_S, Env
from bench.chaos_load import Load, Result

ALL_FAULTS = ("db_refused", "db_blackholed", "redis_refused", "redis_blackholed",
              "worker_killed", "worker_blackholed", "gateway_sigkill", "start_worker_down",
              "outbox_disk_full")
FAST_FAULTS = ("db_blackholed", "redis_refused", "worker_killed", "gateway_sigkill")
WORKER_FAULTS = ("worker_killed", "worker_blackholed", "start_worker_down")
WORKER_BACK_WAIT_S = 15.0
MID_STREAM_WAIT_S = 10.0


def _watch_ready(env: Env, since: float, stop: threading.Event, out: dict[str, Any]) -> None:
    while not stop.is_set():
        try:
            response = httpx.get(env.gateway + "/readyz", timeout=2)
            body = response.json()
            noticed = response.status_code != 200 or not all(body.get("upstreams", {}).values())
            if noticed:
                down = body.get("down") or [n for n, ok in body.get("upstreams", {}).items()
                                            if not ok]
                out.setdefault("readyz_s", round(time.monotonic() - since, 2))
                out.setdefault("readyz_down", down)
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.1)


Fault = tuple[Callable[[Env], None], Callable[[Env], None]]


def _disk_full(env: Env) -> None:
    filler = env.data_dir() / "filler"
    try:
        with open(filler, "wb") as f:
            while True:
                f.write(b"\0" * 65536)
    except OSError:
        pass  # full


def _restart_gateway(env: Env) -> None:
    env.procs["gateway"].wait()
    env.start_gateway()


def _restart_without_w1(env: Env) -> None:
    """Stop w1's link, then restart the gateway gracefully: it must start on w2 alone."""
    env.proxies["w1"].stop()
    env.procs["gateway"].terminate()
    env.procs["gateway"].wait()
    env.start_gateway()


FAULTS: dict[str, Fault] = {
    "db_refused": (lambda e: e.proxies["db"].stop(), lambda e: e.proxies["db"].start()),
    "db_blackholed": (lambda e: e.proxies["db"].blackhole(), lambda e: e.proxies["db"].start()),
    "redis_refused": (lambda e: e.proxies["redis"].stop(), lambda e: e.proxies["redis"].start()),
    "redis_blackholed": (lambda e: e.proxies["redis"].blackhole(),
                         lambda e: e.proxies["redis"].start()),
    "worker_killed": (lambda e: e.procs["w1"].kill(), lambda e: e.start_worker("w1")),
    "worker_blackholed": (lambda e: e.proxies["w1"].blackhole(),
                          lambda e: e.proxies["w1"].start()),
    "gateway_sigkill": (lambda e: e.procs["gateway"].kill(), _restart_gateway),
    "start_worker_down": (_restart_without_w1, lambda e: e.proxies["w1"].start()),
    "outbox_disk_full": (_disk_full,
                         lambda e: (e.data_dir() / "filler").unlink(missing_ok=True)),
}


def run_fault(env: Env, name: str, clients: int, phase_s: float, fault_s: float,
              worker_back_wait_s: float = WORKER_BACK_WAIT_S) -> dict[str, Any]:
    """One fault's run and reconciliation (see module doc); after a worker fault the load
    stays on until w1 serves again, for at most ``worker_back_wait_s``."""
    inject, heal = FAULTS[name]
    load = Load(env.gateway, env.key, NUM_WORDS, clients)
    load.start()
    time.sleep(phase_s)
    load.wait_mid_stream(MID_STREAM_WAIT_S)  # the fault lands on live streams
    injected = time.monotonic()
    watch: dict[str, Any] = {}
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_ready, args=(env, injected, stop, watch),
                               daemon=True)
    inject(env)
    watcher.start()
    time.sleep(fault_s)
    heal(env)
    healed = time.monotonic()
    time.sleep(phase_s)
    if name in WORKER_FAULTS:  # keep the load on until w1 serves again (the goal: <= 10 s)
        port = env.proxies["w1"].port
        while (time.monotonic() - healed < worker_back_wait_s
               and _first_use(list(load.results), healed, port) is None):
            time.sleep(0.2)
    load.stop()
    stop.set()
    watcher.join()
    return _reconcile(env, name, load.results, injected, healed, watch)


def _drained(env: Env, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            body = httpx.get(env.gateway + "/readyz", timeout=2).json()
            if body.get("outbox_depth") == 0 and body.get("ledger") == "ok":
                return True
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    return False


def _reconcile(env: Env, name: str, results: list[Result], injected: float, healed: float,
               watch: dict[str, Any]) -> dict[str, Any]:
    drained = _drained(env)
    ok = [r for r in results if r.status == "200"]
    cut = [r for r in results if r.status == "cut" and r.request_id]
    ids = {r.request_id for r in results if r.request_id}
    rows = env.ledger({i for i in ids if i})
    per_id = Counter(rid for rid, _, _ in rows)
    billed = {rid: tokens for rid, tokens, _ in rows}
    normal = sorted(r.ended - r.started for r in results if r.ended < injected)
    during = sorted(r.ended - r.started for r in results
                    if r.ended >= injected and r.started <= healed)
    gaps = [r.tokens - billed[r.request_id] for r in cut if r.request_id in billed]
    return {
        "fault": name,
        "requests": len(results),
        "ok": len(ok),
        "errors": dict(Counter(r.status for r in results if r.status != "200")),
        "max_latency_normal_s": round(max(normal, default=0.0), 3),
        "max_latency_fault_s": round(max(during, default=0.0), 3),
        "latency_bound_s": round(WORKER_READ_TIMEOUT_S + 1 + max(normal, default=0.0), 3),
        "p99_normal_s": _p99(normal),
        "p99_fault_s": _p99(during),
        "w1_used_after_heal_s": _first_use(results, healed, env.proxies["w1"].port),
        "readyz_s": watch.get("readyz_s"),
        "readyz_down": watch.get("readyz_down"),
        "drained": drained,
        "ledger_rows": len(rows),
        "lost": sum(1 for r in ok if r.request_id not in billed),
        "doubled": sum(n - 1 for n in per_id.values()),
        "ok_tokens_delivered": sum(r.tokens for r in ok),
        "ok_token_diff": sum(billed.get(r.request_id or "", 0) - r.tokens for r in ok),
        "cut_streams": len(cut),
        "cut_unbilled": sum(1 for r in cut if r.request_id not in billed),
        "cut_token_gap_max": max(gaps, default=0),
        "journal_tokens": JOURNAL_TOKENS,
    }


def _first_use(results: list[Result], healed: float, port: int) -> float | None:
    """Seconds from the heal until a request was first answered by worker w1."""
    starts = [r.started for r in results
              if r.started >= healed and r.worker and r.worker.endswith(f":{port}")]
    return round(min(starts) - healed, 2) if starts else None


def _p99(sorted_values: list[float]) -> float | None:
    if not sorted_values:
        return None
    return round(sorted_values[min(len(sorted_values) - 1, int(0.99 * len(sorted_values)))], 3)


def _mount_tmpfs(work: Path) -> Path | None:
    target = work / "tmpfs"
    target.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(target)],
                          capture_output=True, check=False)
    return target if done.returncode == 0 else None


def run(faults: list[str], clients: int, phase_s: float, fault_s: float, *,
        pg: str | None = None, redis: str | None = None,
        worker_back_wait_s: float = WORKER_BACK_WAIT_S) -> list[dict[str, Any]]:
    """Run ``faults`` in order on one set of services; one JSON line each (printed)."""
    pg = pg or os.environ["KVTOLL_TEST_DATABASE_URL"]
    redis = redis or os.environ["KVTOLL_TEST_REDIS_URL"]
    work = Path(tempfile.mkdtemp(prefix="kvtoll-chaos-"))
    env = Env(pg, redis, work)
    if "outbox_disk_full" in faults:
        env.tmpfs = _mount_tmpfs(work)
    out: list[dict[str, Any]] = []
    try:
        env.start()
        for name in faults:
            if name == "outbox_disk_full" and env.tmpfs is None:
                line: dict[str, Any] = {"fault": name, "skipped": "needs a tmpfs mount (root)"}
            else:
                line = run_fault(env, name, clients, phase_s, fault_s, worker_back_wait_s)
            print(json.dumps(line), flush=True)
            out.append(line)
    finally:
        env.close()
        shutil.rmtree(work, ignore_errors=True)
    return out


def table(lines: list[dict[str, Any]]) -> str:
    cols = ("fault", "ok", "errors", "p99_normal_s", "p99_fault_s", "max_latency_fault_s",
            "latency_bound_s", "readyz_s", "w1_used_after_heal_s",
            "lost", "doubled", "ok_token_diff", "cut_streams", "cut_token_gap_max")
    rows = [[str(line.get(c, "")) for c in cols] for line in lines]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*cols)] + [fmt.format(*r) for r in rows])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="one fault of each kind, short load")
    parser.add_argument("--faults", default="", help="comma-separated subset of the faults")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--phase-s", type=float, default=None)
    parser.add_argument("--fault-s", type=float, default=None)
    args = parser.parse_args(argv)
    faults = [f for f in args.faults.split(",") if f] or list(
        FAST_FAULTS if args.fast else ALL_FAULTS)
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        parser.error(f"unknown faults {unknown}; choose from {', '.join(ALL_FAULTS)}")
    phase = args.phase_s if args.phase_s is not None else (1.0 if args.fast else 2.0)
    fault = args.fault_s if args.fault_s is not None else (3.0 if args.fast else 6.0)
    lines = run(faults, args.clients, phase, fault)
    print(table(lines), file=sys.stderr)


if __name__ == "__main__":
    main()
