"""The gateway's added latency and throughput over calling the same upstream directly,
beside the peer gateways the issue names, in the same run.

A fixed-latency OpenAI-compatible upstream (``fixed_upstream.py``, started by this script:
``--upstream-ms`` of sleep, then a short chat completion) runs in its own process;
kvtoll runs as deployed: ``kvtoll serve --worker <upstream> --no-semantic-cache
--tokenizer none`` (the CLI, uvicorn, key auth, the per-key rate limiter, metering
through the outbox into a SQLite ledger, its ledger writer process). With
``--thread-writer`` a second kvtoll gateway with ``KVTOLL_LEDGER_WRITER=thread`` (the
ledger written in a thread of the serving process, as before issue 32) is measured
beside it. The baseline is the same client calling the upstream directly; the peers are
Portkey's gateway and the LiteLLM proxy in front of the same upstream
(``gateway_peers.py``; installed by ``bench/install_peers.sh``, skipped with the reason
when absent)::

    latency:    sequential requests on one keep-alive client: for each gateway a block
                in which its calls alternate with direct ones; added = through the
                gateway - direct at p50, p99 and p99.9 within the block (the upstream's
                latency cancels); the per-turn added latency over request index is
                plotted (--plot) and tested for a spike train (latency_series.py)
    throughput: closed loop with each of --concurrency clients (1, 8, 32) for --seconds,
                through each gateway and directly: requests/s and p50/p99/p99.9; one
                lean raw-HTTP/1.1 client on uvloop (when installed; throughput's
                client_loop says) for every target alike
    ledger:     every kvtoll response's x-kvtoll-request-id against the ledger once the
                outbox drained: lost (answered, no row) and extra (row, never answered)

    python bench/proxy_overhead.py [--requests 1000] [--rounds 2] [--upstream-ms 5]
        [--concurrency 1,8,32] [--seconds 5] [--warmup 50] [--peers portkey,litellm|none]
        [--thread-writer] [--plot bench/out/proxy_overhead_added.png]

Also reported: CPU milliseconds per request of every process tree (from /proc; kvtoll's
includes its ledger writer) and the load average, since on a shared machine the
scheduler, not the code, dominates the added latency. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as ``python bench/<script>.py``: the repo root, for bench.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from bench import gateway_peers, latency_series, ledger_audit
from bench.engine_servers import free_port
from bench.fixed_upstream import MODEL, serve_upstream
from bench.gateway_process import ROOT, seed_database, spawn_gateway, spawn_peer, wait_ready


# ---------------------------------------------------------------- the client side
def spawn(*args: str, nice: int = 0) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, __file__, *args], cwd=ROOT, env=env,
                            preexec_fn=(lambda: os.nice(nice)) if nice else None)


BODY = {"model": MODEL, "messages": [{"role": "user", "content": "count to four"}],
        "max_tokens": 16}


@dataclass(frozen=True)
class Target:
    """One way of reaching the upstream: directly, through kvtoll, through a peer."""

    name: str
    url: str
    headers: dict[str, str]
    pid: int  # the process whose CPU time is charged to it (with its descendants)
    database_url: str | None = None  # kvtoll's ledger


@dataclass
class Answered:
    """Request ids kvtoll answered with, per gateway (checked against its ledger)."""

    ids: dict[str, list[str]] = field(default_factory=dict)

    def add(self, target: Target, request_id: str | None) -> None:
        if target.database_url is not None:
            self.ids.setdefault(target.name, []).append(request_id or "<missing>")


def percentile(values: list[float], q: float) -> float:
    return latency_series.percentile(values, q)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (Linux ``/proc``)."""
    return gateway_peers.process_tree_cpu_seconds(pid, descendants=False)


def _timed_block(client: httpx.Client, pair: tuple[Target, Target], requests: int,
                 warmup: int, answered: Answered) -> dict[str, list[float]]:
    """``warmup + requests`` turns of one direct call then one call through the gateway;
    the milliseconds of the measured turns, and (key ``t``) each turn's start in s."""
    times: dict[str, list[float]] = {t.name: [] for t in pair}
    times["t"] = []
    origin = time.perf_counter()
    for i in range(requests + warmup):
        for target in pair:
            t0 = time.perf_counter()
            response = client.post(target.url + "/v1/chat/completions", json=BODY,
                                   headers=target.headers)
            elapsed = (time.perf_counter() - t0) * 1000
            if response.status_code != 200:
                raise RuntimeError(f"{target.name}: {response.status_code} {response.text}")
            answered.add(target, response.headers.get("x-kvtoll-request-id"))
            if i >= warmup:
                times[target.name].append(elapsed)
        if i >= warmup:
            times["t"].append(t0 - origin)
    return times


def measure_latency(targets: list[Target], requests: int, warmup: int, answered: Answered,
                    series: dict[str, list[float]]) -> dict[str, Any]:
    """Sequential requests; milliseconds. ``targets[0]`` is the direct call; each other
    target (a gateway) gets a block of its own in which its calls alternate with direct
    ones, so that work a gateway does after answering (logging, metering) lands in its
    own block and not in another gateway's. A gateway's added latency is its p50 (p99,
    p99.9) minus that of the direct calls of its block; its CPU ms per request is that
    of its process tree over the block. Each turn's added latency (gateway - direct of
    the same turn) is appended to ``series[name]``."""
    direct = targets[0]
    out: dict[str, Any] = {}
    with httpx.Client(timeout=30) as client:
        for target in targets[1:]:
            before = gateway_peers.process_tree_cpu_seconds(target.pid)
            times = _timed_block(client, (direct, target), requests, warmup, answered)
            after = gateway_peers.process_tree_cpu_seconds(target.pid)
            name = target.name
            for q, level in (("p50", 0.5), ("p99", 0.99), ("p999", 0.999)):
                ours, base = percentile(times[name], level), percentile(times[direct.name], level)
                out[f"{name}_{q}_ms"] = round(ours, 3)
                out[f"{name}_added_{q}_ms"] = round(ours - base, 3)
            out[f"{name}_cpu_ms_per_request"] = round(
                (after - before) * 1000 / (requests + warmup), 3)
            added = [g - d for g, d in zip(times[name], times[direct.name], strict=True)]
            series.setdefault(name, []).extend(added)
            for q, value in latency_series.tail(added).items():
                out[f"{name}_paired_added_{q}"] = value  # percentiles of per-turn added
            out[f"{name}_periodicity"] = latency_series.periodicity(
                times["t"], added, SPIKE_MS, PERIODS_S)
    out["load_average_1m"] = os.getloadavg()[0]
    return out


SPIKE_MS = 3.0  # an added latency above this is a spike
PERIODS_S = [p / 1000 for p in range(100, 501, 2)]  # trial spike-train periods


def closed_loop(target: Target, concurrency: int, seconds: float,
                answered: Answered) -> dict[str, Any]:
    """Requests/s and latency percentiles through ``target`` with ``concurrency``
    keep-alive clients, and the CPU ms per request of its process tree meanwhile."""
    before = gateway_peers.process_tree_cpu_seconds(target.pid)
    result = latency_series.run_client(latency_series.closed_loop(
        target.url, target.headers, BODY, concurrency, seconds))
    cpu = gateway_peers.process_tree_cpu_seconds(target.pid) - before
    for request_id in result.request_ids:
        answered.add(target, request_id)
    missing = len(result.latencies_ms) - len(result.request_ids)
    for _ in range(missing if target.database_url else 0):
        answered.add(target, None)
    done = len(result.latencies_ms)
    return {"requests_per_s": round(done / result.elapsed_s, 1), "errors": result.errors,
            **(latency_series.tail(result.latencies_ms) if done else {}),
            "cpu_ms_per_request": round(cpu * 1000 / done, 3) if done else None}


def start_peers(names: list[str], upstream: str, tmp: Path, nice: int,
                procs: list[subprocess.Popen[bytes]]) -> tuple[list[Target], dict[str, str]]:
    """Start every named peer that is installed; the others are returned with the
    reason they were skipped. Started processes are appended to ``procs``."""
    targets: list[Target] = []
    skipped: dict[str, str] = {}
    for name in names:
        port = free_port()
        launch = gateway_peers.LAUNCHERS[name](port, upstream, tmp)
        if isinstance(launch, str):
            skipped[name] = launch
            continue
        proc = spawn_peer(launch, tmp / f"{name}.log", nice)
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, proc, health_path=launch.health_path)
        except RuntimeError as exc:
            skipped[name] = f"{exc}; see {tmp / f'{name}.log'}"
            continue
        targets.append(Target(name, url, launch.headers, proc.pid))
    return targets, skipped


def _median(rounds: list[dict[str, Any]], key: str) -> float:
    return round(statistics.median(r[key] for r in rounds), 3)


def added_summary(rounds: list[dict[str, Any]], name: str) -> dict[str, float]:
    """A gateway's added p50 / p99 / p99.9, each the median over the rounds."""
    return {f"added_{q}_ms": _median(rounds, f"{name}_added_{q}_ms")
            for q in ("p50", "p99", "p999")}


def peer_summary(rounds: list[dict[str, Any]], peers: list[Target],
                 throughput: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Each peer's added latency and throughput in this run beside kvtoll's, and kvtoll's
    added p50 carried over to the machine the issue's figure for that peer came from
    (kvtoll's p50 times the peer's reference over the peer's p50 here): the ratio is
    what this noisy machine measures well."""
    ours = _median(rounds, "kvtoll_added_p50_ms")
    out: dict[str, Any] = {}
    for peer in peers:
        added = added_summary(rounds, peer.name)
        p50 = added["added_p50_ms"]
        reference = gateway_peers.REFERENCE_ADDED_P50_MS[peer.name]
        scaled = ours * reference / p50 if p50 > 0 else None
        out[peer.name] = {
            **added,
            "kvtoll_added_p50_over_peer": round(ours / p50, 3) if p50 > 0 else None,
            "reference_added_p50_ms": reference,
            "kvtoll_added_p50_ms_at_reference": None if scaled is None else round(scaled, 3),
            "kvtoll_throughput_over_peer": {
                c: round(t["kvtoll"]["requests_per_s"] / t[peer.name]["requests_per_s"], 2)
                for c, t in throughput.items() if t[peer.name]["requests_per_s"]},
        }
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="kvtoll-bench-"))
    up_port = free_port()
    direct_url = f"http://127.0.0.1:{up_port}"
    if args.nice:
        os.nice(args.nice)  # this process (the clients); the servers get the same below
    procs = [spawn("--serve-upstream", str(args.upstream_ms), str(up_port), nice=args.nice)]
    variants = [("kvtoll", "process")] + ([("kvtoll_thread", "thread")] if args.thread_writer
                                           else [])
    concurrencies = [int(c) for c in args.concurrency.split(",") if c]
    try:
        wait_ready(direct_url, procs[0])
        gateways = []
        for name, writer in variants:
            database_url = f"sqlite:///{tmp / name}.db"
            key = seed_database(database_url)
            port = free_port()
            procs.append(spawn_gateway(direct_url, database_url, str(tmp / f"{name}-data"),
                                       port, writer, args.nice))
            url = f"http://127.0.0.1:{port}"
            wait_ready(url, procs[-1])
            gateways.append(Target(name, url, {"Authorization": f"Bearer {key}"},
                                   procs[-1].pid, database_url))
        direct = Target("direct", direct_url, {}, procs[0].pid)
        names = [] if args.peers == "none" else [n for n in args.peers.split(",") if n]
        peers, skipped = start_peers(names, direct_url, tmp, args.nice, procs)
        targets = [direct, *gateways, *peers]
        answered, series = Answered(), dict[str, list[float]]()
        rounds = [measure_latency(targets, args.requests, args.warmup, answered, series)
                  for _ in range(args.rounds)]
        throughput = {c: {t.name: closed_loop(t, c, args.seconds, answered) for t in targets}
                      for c in concurrencies}
        ledgers = {g.name: ledger_audit.check(g.database_url or "", answered.ids.get(g.name, []))
                   for g in gateways}
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)
    if args.plot:
        path = Path(args.plot)
        path.parent.mkdir(parents=True, exist_ok=True)
        latency_series.plot_added(
            {t.name: series[t.name] for t in targets[1:]}, path,
            f"added latency per request (gateway - direct, same turn), {args.rounds} rounds "
            f"x {args.requests}; upstream {args.upstream_ms} ms; load {os.getloadavg()[0]:.1f}")
    ours = added_summary(rounds, "kvtoll")
    top = max(concurrencies)
    portkey_rps = throughput[top].get("portkey", {}).get("requests_per_s")
    return {
        "benchmark": "proxy_overhead",
        "cpu_count": os.cpu_count(),
        "nice": args.nice,
        "upstream_latency_ms": args.upstream_ms,
        "requests_per_variant": args.requests,
        "warmup_per_variant": args.warmup,
        "latency_rounds": rounds,
        "kvtoll": ours,
        "gateways": {g.name: added_summary(rounds, g.name) for g in gateways},
        "peers": peer_summary(rounds, peers, throughput),
        "peers_skipped": skipped,
        "throughput": {"seconds": args.seconds, "client_loop": latency_series.client_loop(),
                       **{str(c): t for c, t in throughput.items()}},
        "ledger": ledgers,
        "plot": args.plot or None,
        "goals": {
            "added_p50_le_1ms": ours["added_p50_ms"] <= 1.0,
            "added_p99_le_2ms": ours["added_p99_ms"] <= 2.0,
            f"throughput_{top}_ge_3x_portkey": None if not portkey_rps else
            throughput[top]["kvtoll"]["requests_per_s"] >= 3 * portkey_rps,
            "ledger_exact": all(not (v["lost"] or v["extra"] or v["doubled"])
                                for v in ledgers.values()),
        },
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-upstream":
        serve_upstream(float(sys.argv[2]), int(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--upstream-ms", type=float, default=5.0)
    parser.add_argument("--concurrency", default="1,8,32",
                        help="comma-separated numbers of closed-loop clients")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=50,
                        help="unmeasured requests per target before each round (a JIT warms)")
    parser.add_argument("--peers", default="portkey,litellm",
                        help="comma-separated peer gateways to measure in the same run, "
                             "of: " + ", ".join(gateway_peers.LAUNCHERS) + "; or none "
                             "(installed by bench/install_peers.sh; a missing one is "
                             "skipped and said so)")
    parser.add_argument("--thread-writer", action="store_true",
                        help="also measure kvtoll with KVTOLL_LEDGER_WRITER=thread")
    parser.add_argument("--plot", default="bench/out/proxy_overhead_added.png",
                        help="PNG of added latency over request index ('' for none)")
    parser.add_argument("--nice", type=int, default=0,
                        help="niceness for every benchmark process (negative needs root; "
                             "on a shared machine it keeps other work from preempting them)")
    args = parser.parse_args()
    unknown = set(args.peers.split(",")) - set(gateway_peers.LAUNCHERS) - {"", "none"}
    if unknown:
        parser.error(f"unknown peer(s): {', '.join(sorted(unknown))}")
    print(json.dumps(run(args), indent=2))


if __name__ == "__main__":
    main()
