"""The gateway's added latency and throughput over calling the same upstream directly.

A fixed-latency OpenAI-compatible upstream (a raw ASGI app started by this script:
``--upstream-ms`` of sleep, then a short chat completion, streamed or whole) runs in
its own process; the gateway runs in another (uvicorn configured as ``kvtoll serve``
does, :func:`proxy.server.server_config`; the real ``create_app`` with key auth and
metering on SQLite, the upstream reached with ``HttpUpstream``). The
peer is the same client calling the upstream directly, in the same run::

    latency:    sequential requests, direct and proxied interleaved; added = proxied - direct
                at p50 and p99 (the upstream's fixed latency cancels out)
    throughput: closed loop with --concurrency clients for --seconds, through the gateway
                (and directly, for reference); every process shares this machine's cores

    python bench/proxy_overhead.py [--requests 400] [--rounds 3] [--upstream-ms 5]
        [--concurrency 32] [--seconds 8]

Also reported: CPU milliseconds per request of the gateway and upstream processes
(from /proc) and the load average, since on a shared machine the scheduler, not the
code, dominates the added latency.

Prints one JSON object. Goal: p50 added <= 1 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
MODEL = "fixed-latency"
ASGIReceive = Callable[[], Awaitable[dict[str, Any]]]
ASGISend = Callable[[dict[str, Any]], Awaitable[None]]


# ---------------------------------------------------------------- the fixed upstream
def _completion(stream: bool) -> list[bytes]:
    meta = {"id": "chatcmpl-bench", "created": 0, "model": MODEL}
    usage = {"prompt_tokens": 12, "completion_tokens": 4, "total_tokens": 16,
             "prompt_tokens_details": {"cached_tokens": 0}}
    if not stream:
        body = {**meta, "object": "chat.completion", "usage": usage, "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "one two three four"},
             "finish_reason": "stop", "logprobs": None}]}
        return [json.dumps(body).encode()]
    frames = []
    words = ["one", " two", " three", " four"]
    for i, word in enumerate(words):
        choice = {"index": 0, "delta": {"content": word}, "logprobs": None,
                  "finish_reason": "stop" if i == len(words) - 1 else None}
        chunk = {**meta, "object": "chat.completion.chunk", "choices": [choice]}
        frames.append(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    last = {**meta, "object": "chat.completion.chunk", "choices": [], "usage": usage}
    frames.append(b"data: " + json.dumps(last).encode() + b"\n\n")
    frames.append(b"data: [DONE]\n\n")
    return frames


def make_upstream(latency_s: float) -> Callable[..., Awaitable[None]]:
    """A raw ASGI app: /healthz, /v1/models and a fixed chat completion."""
    whole, streamed = _completion(False), _completion(True)
    models = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()

    async def app(scope: dict[str, Any], receive: ASGIReceive, send: ASGISend) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        path = scope["path"]
        if path != "/v1/chat/completions":
            payload = models if path == "/v1/models" else b'{"status":"ok"}'
            await _send(send, [payload], "application/json")
            return
        await asyncio.sleep(latency_s)
        stream = b'"stream":true' in body.replace(b" ", b"")
        await _send(send, streamed if stream else whole,
                    "text/event-stream" if stream else "application/json")

    return app


async def _send(send: ASGISend, parts: list[bytes], content_type: str) -> None:
    headers = [(b"content-type", content_type.encode())]
    if len(parts) == 1:
        headers.append((b"content-length", str(len(parts[0])).encode()))
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    for i, part in enumerate(parts):
        await send({"type": "http.response.body", "body": part,
                    "more_body": i < len(parts) - 1})


# ---------------------------------------------------------------- the gateway process
def seed_database(url: str) -> str:
    """Migrate a fresh SQLite file, add a tenant, an unthrottled key and a price."""
    from billing import accounts, pricing
    from billing.db import make_engine, session_factory
    from billing.migrate import upgrade

    upgrade(url)
    engine = make_engine(url)
    with session_factory(engine).begin() as session:
        accounts.create_tenant(session, "bench")
        _, key = accounts.create_key(session, "bench", requests_per_minute=accounts.MAX_LIMIT,
                                     tokens_per_minute=accounts.MAX_LIMIT)
        pricing.set_price(session, MODEL, "1", "0.5", "2", "0.1")
    engine.dispose()
    return key


def serve_gateway(upstream_url: str, database_url: str, data_dir: str, port: int) -> None:
    import uvicorn

    from billing.db import make_engine, session_factory
    from proxy.app import create_app
    from proxy.server import server_config
    from proxy.settings import load_settings
    from proxy.upstream.http import HttpUpstream, HttpUpstreamConfig

    settings = load_settings(database_url=database_url, data_dir=data_dir, redis_url=None,
                             admin_token="bench-admin-token-0123456789", secret="bench-secret")
    app = create_app(settings, upstreams=[HttpUpstream(HttpUpstreamConfig(upstream_url))],
                     session_factory=session_factory(make_engine(database_url)), models=[MODEL])
    uvicorn.Server(server_config(app, host="127.0.0.1", port=port, log_level="warning")).run()


def serve_upstream(latency_ms: float, port: int) -> None:
    import uvicorn

    uvicorn.run(make_upstream(latency_ms / 1000), host="127.0.0.1", port=port,
                log_level="warning", access_log=False, lifespan="off")


# ---------------------------------------------------------------- the client side
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def spawn(*args: str, nice: int = 0) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, __file__, *args], cwd=ROOT, env=env,
                            preexec_fn=(lambda: os.nice(nice)) if nice else None)


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server for {url} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


BODY = {"model": MODEL, "messages": [{"role": "user", "content": "count to four"}],
        "max_tokens": 16}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure_latency(direct: str, proxied: str, key: str, requests: int) -> dict[str, Any]:
    """Interleaved sequential requests; milliseconds."""
    times: dict[str, list[float]] = {"direct": [], "proxied": []}
    auth = {"Authorization": f"Bearer {key}"}
    with httpx.Client(timeout=30) as client:
        for i in range(requests + 20):
            for name, url in (("direct", direct), ("proxied", proxied)):
                t0 = time.perf_counter()
                response = client.post(url + "/v1/chat/completions", json=BODY, headers=auth)
                elapsed = (time.perf_counter() - t0) * 1000
                if response.status_code != 200:
                    raise RuntimeError(f"{name}: {response.status_code} {response.text}")
                if i >= 20:  # warm-up
                    times[name].append(elapsed)
    out: dict[str, Any] = {}
    for name, values in times.items():
        out[f"{name}_p50_ms"] = round(statistics.median(values), 3)
        out[f"{name}_p99_ms"] = round(percentile(values, 0.99), 3)
    out["added_p50_ms"] = round(out["proxied_p50_ms"] - out["direct_p50_ms"], 3)
    out["added_p99_ms"] = round(out["proxied_p99_ms"] - out["direct_p99_ms"], 3)
    return out


async def _closed_loop(url: str, key: str, concurrency: int, seconds: float) -> dict[str, Any]:
    auth = {"Authorization": f"Bearer {key}"}
    done = errors = 0
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        stop_at = time.perf_counter() + seconds

        async def worker() -> None:
            nonlocal done, errors
            while time.perf_counter() < stop_at:
                response = await client.post(url + "/v1/chat/completions", json=BODY,
                                             headers=auth)
                if response.status_code == 200:
                    done += 1
                else:
                    errors += 1

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return {"requests_per_s": round(done / elapsed, 1), "errors": errors}


def ledger_rows(database_url: str) -> int:
    from sqlalchemy import create_engine, text

    engine = create_engine(database_url)
    with engine.connect() as conn:
        count = int(conn.execute(text("SELECT count(*) FROM usage_ledger")).scalar_one())
    engine.dispose()
    return count


def run(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="kvtoll-bench-"))
    database_url = f"sqlite:///{tmp / 'kvtoll.db'}"
    key = seed_database(database_url)
    up_port, gw_port = free_port(), free_port()
    direct, proxied = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{gw_port}"
    if args.nice:
        os.nice(args.nice)  # this process (the clients); the servers get the same below
    procs = [spawn("--serve-upstream", str(args.upstream_ms), str(up_port), nice=args.nice)]
    try:
        wait_ready(direct, procs[0])
        procs.append(spawn("--serve-gateway", direct, database_url, str(tmp / "data"),
                           str(gw_port), nice=args.nice))
        wait_ready(proxied, procs[1])
        rounds = []
        for _ in range(args.rounds):
            cpu_before = [cpu_seconds(p.pid) for p in procs]
            latency = measure_latency(direct, proxied, key, args.requests)
            cpu_after = [cpu_seconds(p.pid) for p in procs]
            per_request = [(a - b) * 1000 / (args.requests + 20)
                           for a, b in zip(cpu_after, cpu_before, strict=True)]
            latency["upstream_cpu_ms_per_request"] = round(per_request[0] / 2, 3)
            latency["gateway_cpu_ms_per_request"] = round(per_request[1], 3)
            latency["load_average_1m"] = os.getloadavg()[0]
            rounds.append(latency)
        through = asyncio.run(_closed_loop(proxied, key, args.concurrency, args.seconds))
        reference = asyncio.run(_closed_loop(direct, key, args.concurrency, args.seconds))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)
    return {
        "benchmark": "proxy_overhead",
        "cpu_count": os.cpu_count(),
        "nice": args.nice,
        "upstream_latency_ms": args.upstream_ms,
        "requests_per_variant": args.requests,
        "latency_rounds": rounds,
        "added_p50_ms_median_of_rounds": statistics.median(r["added_p50_ms"] for r in rounds),
        "added_p99_ms_median_of_rounds": statistics.median(r["added_p99_ms"] for r in rounds),
        "goal_p50_added_le_1ms": statistics.median(r["added_p50_ms"] for r in rounds) <= 1.0,
        "throughput": {"concurrency": args.concurrency, "seconds": args.seconds,
                       "proxied": through, "direct": reference},
        "ledger_rows": ledger_rows(database_url),
        "ledger_rows_expected_min": args.rounds * (args.requests + 20),
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-upstream":
        serve_upstream(float(sys.argv[2]), int(sys.argv[3]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-gateway":
        serve_gateway(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--upstream-ms", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nice", type=int, default=0,
                        help="niceness for every benchmark process (negative needs root; "
                             "on a shared machine it keeps other work from preempting them)")
    print(json.dumps(run(parser.parse_args()), indent=2))


if __name__ == "__main__":
    main()
