"""Semantic hits per second through the HTTP API (the full gateway app).

Processes (all on this machine): the fixed-latency upstream (``fixed_upstream.py``)
and the gateway (uvicorn, the real ``create_app`` with key auth, metering on SQLite
and the semantic cache: MiniLM + FAISS + verifier, in-process store). The client
first asks ``--questions`` distinct questions (misses, answered upstream and stored),
then runs a closed loop of ``--concurrency`` clients for ``--seconds`` asking
rewordings of them (case/punctuation variants and paraphrases), counting responses
with ``x-kvtoll-cache: semantic``. Peer in the same run: the same loop with
``Cache-Control: no-cache`` (every request goes upstream). Goal: >= 300 hits/s.

The load client shares the two cores with the servers, so its own cost is part of the
figure. ``--client lean`` (default) is the keep-alive HTTP/1.1 client of
``semantic_load.py``; ``--client httpx`` is httpx's AsyncClient, which on this CPU
spends about as much CPU per request as the gateway. CPU milliseconds per request of
the gateway, the upstream and the client (from /proc and getrusage) are reported.

    python bench/semantic_http.py [--questions 40] [--concurrency 32] [--seconds 8]
        [--client lean|httpx]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as ``python bench/<script>.py``: the repo root, for bench.*
    # bench/ itself must not be on the path: bench/kernels.py shadows the ``kernels``
    # package that transformers probes for (the cross-encoder imports BertModel)
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import httpx

from bench import gateway_process as gp
from bench import proxy_overhead as po
from bench import semantic_load
from bench.engine_servers import free_port
from bench.fixed_upstream import MODEL, serve_upstream

QUESTIONS = [
    "What is the capital of {}?", "How do I apply for a visa to {}?",
    "What is the population of {}?", "What currency is used in {}?",
]  # fmt: skip
PLACES = ["France", "Japan", "Kenya", "Peru", "Norway", "Canada", "Egypt", "Chile", "India",
          "Spain"]  # fmt: skip
REWORDINGS = [
    lambda q: q,
    lambda q: q.lower().rstrip("?"),
    lambda q: q.replace("What is", "What's"),
]


def serve_gateway(
    upstream_url: str,
    database_url: str,
    data_dir: str,
    port: int,
    embed_memo: int,
    embed_workers: int,
    embed_threads: int,
    verifier: str = "logistic",
) -> None:
    import uvicorn

    from billing.db import make_engine, session_factory
    from kvtoll.settings import load_settings
    from proxy.app import create_app
    from proxy.cli.serve import server_config
    from proxy.deps import get_key
    from proxy.semantic.factory import VERIFIER_CHOICES, build_semantic_cache
    from proxy.semantic.gateway import SemanticCacheAdapter
    from proxy.semantic.routes import build_cache_router
    from proxy.semantic.service import SemanticConfig
    from proxy.upstream.http import HttpUpstream, HttpUpstreamConfig

    settings = load_settings(
        database_url=database_url, data_dir=data_dir, redis_url=None,
        admin_token="bench-admin-token-0123456789", secret="bench-secret",
    )  # fmt: skip
    # embed_memo=0: every lookup embeds its text (no reuse of a repeated query's vector).
    # embed_threads=0: each embedding worker uses torch's process-wide thread count.
    config = SemanticConfig(
        embed_memo_size=embed_memo,
        embed_workers=embed_workers,
        embed_threads_per_worker=embed_threads or None,
    )
    cache = build_semantic_cache(
        None, config=config, verifier=verifier if verifier in VERIFIER_CHOICES else "logistic"
    )
    app = create_app(
        settings, upstreams=[HttpUpstream(HttpUpstreamConfig(upstream_url))],
        session_factory=session_factory(make_engine(database_url)), models=[MODEL],
        semantic=SemanticCacheAdapter(cache), resources=[cache],
        extra_routers=[build_cache_router(cache, get_key)],
    )  # fmt: skip
    # served as `kvtoll serve` serves the gateway (proxy.cli.serve.server_config)
    uvicorn.Server(server_config(app, host="127.0.0.1", port=port, log_level="warning")).run()


def body(text: str) -> dict[str, Any]:
    return {"model": MODEL, "temperature": 0, "max_tokens": 16,
            "messages": [{"role": "user", "content": text}]}  # fmt: skip


async def closed_loop(
    url: str, key: str, args: argparse.Namespace, no_cache: bool
) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"}
    if no_cache:
        headers["Cache-Control"] = "no-cache"
    questions = [q.format(p) for q in QUESTIONS for p in PLACES][: args.questions]

    def body_of(n: int) -> dict[str, Any]:
        return body(REWORDINGS[n % len(REWORDINGS)](questions[n % len(questions)]))

    if args.client == "lean":
        counted, elapsed = await semantic_load.closed_loop(
            url, headers, body_of, args.concurrency, args.seconds
        )
        counts = {"semantic": counted.semantic, "other": counted.other, "errors": counted.errors}
    else:
        counts, elapsed = await _httpx_loop(url, headers, body_of, args)
    return {**counts, "semantic_hits_per_s": round(counts["semantic"] / elapsed, 1),
            "requests_per_s": round(sum(counts.values()) / elapsed, 1)}  # fmt: skip


async def _httpx_loop(
    url: str, headers: dict[str, str], body_of: Any, args: argparse.Namespace
) -> tuple[dict[str, int], float]:
    counts = {"semantic": 0, "other": 0, "errors": 0}
    async with httpx.AsyncClient(
        timeout=60, limits=httpx.Limits(max_connections=args.concurrency)
    ) as client:
        stop_at = time.perf_counter() + args.seconds

        async def worker(n: int) -> None:
            while time.perf_counter() < stop_at:
                n += 1
                resp = await client.post(
                    url + "/v1/chat/completions", json=body_of(n), headers=headers
                )
                if resp.status_code != 200:
                    counts["errors"] += 1
                elif resp.headers.get("x-kvtoll-cache") == "semantic":
                    counts["semantic"] += 1
                else:
                    counts["other"] += 1

        started = time.perf_counter()
        await asyncio.gather(*(worker(i * 7) for i in range(args.concurrency)))
        return counts, time.perf_counter() - started


def measured_loop(
    url: str, key: str, args: argparse.Namespace, no_cache: bool, pids: list[int]
) -> dict[str, Any]:
    """:func:`closed_loop` plus CPU ms per request of the servers and of this client."""
    import resource

    def own_cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    before, client_before = [po.cpu_seconds(pid) for pid in pids], own_cpu()
    result = asyncio.run(closed_loop(url, key, args, no_cache))
    after, client_after = [po.cpu_seconds(pid) for pid in pids], own_cpu()
    done = max(1, result["semantic"] + result["other"] + result["errors"])
    upstream, gateway = ((a - b) * 1e3 / done for a, b in zip(after, before, strict=True))
    result["cpu_ms_per_request"] = {
        "gateway": round(gateway, 3), "upstream": round(upstream, 3),
        "client": round((client_after - client_before) * 1e3 / done, 3),
    }  # fmt: skip
    return result


def warm(url: str, key: str, count: int) -> int:
    """Ask each question once (a miss, stored); returns how many were answered."""
    questions = [q.format(p) for q in QUESTIONS for p in PLACES][:count]
    ok = 0
    with httpx.Client(timeout=60) as client:
        for q in questions:
            resp = client.post(url + "/v1/chat/completions", json=body(q),
                               headers={"Authorization": f"Bearer {key}"})  # fmt: skip
            ok += int(resp.status_code == 200)
    return ok


def spawn(*args: str) -> Any:
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(gp.ROOT)}
    return subprocess.Popen([sys.executable, __file__, *args], cwd=gp.ROOT, env=env)


def run(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="kvtoll-sembench-"))
    database_url = f"sqlite:///{tmp / 'kvtoll.db'}"
    key = gp.seed_database(database_url)
    up_port, gw_port = free_port(), free_port()
    direct, proxied = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{gw_port}"
    procs = [spawn("--serve-upstream", str(args.upstream_ms), str(up_port))]
    try:
        gp.wait_ready(direct, procs[0])
        procs.append(
            spawn(
                "--serve-gateway",
                direct,
                database_url,
                str(tmp / "data"),
                str(gw_port),
                str(args.embed_memo),
                str(args.embed_workers),
                str(args.embed_threads),
                args.verifier,
            )
        )
        gp.wait_ready(proxied, procs[1], timeout_s=300)
        warmed = warm(proxied, key, args.questions)
        pids = [proc.pid for proc in procs]
        cached = measured_loop(proxied, key, args, no_cache=False, pids=pids)
        uncached = measured_loop(proxied, key, args, no_cache=True, pids=pids)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)
    return {
        "benchmark": "semantic_http",
        "cpu_count": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "questions_stored": warmed,
        "verifier": args.verifier,
        "embed_memo": args.embed_memo,
        "embed_workers": args.embed_workers,
        "embed_threads_per_worker": args.embed_threads or "torch default",
        "concurrency": args.concurrency,
        "client": args.client,
        "seconds": args.seconds,
        "semantic": cached,
        "peer_no_cache_upstream": uncached,
        "goal_hits_per_s": 300,
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-upstream":
        serve_upstream(float(sys.argv[2]), int(sys.argv[3]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-gateway":
        upstream, database, data_dir = sys.argv[2:5]
        port, memo, workers, threads = (int(a) for a in sys.argv[5:9])
        verifier = sys.argv[9] if len(sys.argv) > 9 else "logistic"
        serve_gateway(upstream, database, data_dir, port, memo, workers, threads, verifier)
        return
    from proxy.semantic.factory import VERIFIER_CHOICES
    from proxy.semantic.service import SemanticConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=40)
    parser.add_argument("--verifier", choices=VERIFIER_CHOICES, default="logistic")
    parser.add_argument("--upstream-ms", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument(
        "--client",
        choices=("lean", "httpx"),
        default="lean",
        help="load client (see the module docstring)",
    )
    parser.add_argument(
        "--embed-memo",
        type=int,
        default=0,
        help="per-tenant embedding memo size; default 0 = every lookup embeds "
        f"(the product default is {SemanticConfig().embed_memo_size})",
    )
    defaults = SemanticConfig()
    parser.add_argument(
        "--embed-workers",
        type=int,
        default=defaults.embed_workers,
        help="embedding worker threads (product default %(default)s)",
    )
    parser.add_argument(
        "--embed-threads",
        type=int,
        default=defaults.embed_threads_per_worker or 0,
        help="torch intra-op threads per embedding worker; 0 = torch's process-wide "
        "setting (product default %(default)s)",
    )
    print(json.dumps(run(parser.parse_args())))


if __name__ == "__main__":
    main()
