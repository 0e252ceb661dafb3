"""What the serving layer costs on top of the engine (a benchmark, not a test).

Peer: the engine called directly (``AsyncEngine.generate``), in the same run, on the
same requests. Compared paths:

* ``engine``            direct engine calls (the peer);
* ``inprocess``         :class:`InProcessUpstream` (what ``kvtoll serve`` uses);
* ``worker_http``       the worker server over HTTP/SSE on localhost (httpx client);
* ``http_upstream``     :class:`HttpUpstream` -> worker server (what the proxy uses
                        with ``--worker``).

Two workloads: ``burst`` (``--requests`` prompts of 16-96 tokens submitted at once,
``--max-tokens`` each, EOS ignored: output tokens/s, time to first token p50/p99) and
``serial`` (``--serial`` one-token requests one after another: per-request latency
p50/p99, i.e. the fixed overhead). The worker runs in this process on the same event
loop as the client (uvicorn on a free port). Prints one JSON object.

    .venv/bin/python bench/worker_serving.py [--model kvtoll-tiny] [--requests 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from engine.api import AsyncEngineClient, GenerationRequest, SamplingParams
from engine.config import TINY_MODEL, EngineConfig
from engine.factory import build_engine
from engine.kv.hashing import derive_tenant_salt
from engine.serving.app import build_worker_app
from kvtoll.openai.sse import aiter_sse_data
from kvtoll.server import serve_in_background
from proxy.upstream.base import Upstream, UpstreamDelta, UpstreamRequest
from proxy.upstream.http import HttpUpstream, HttpUpstreamConfig
from proxy.upstream.inprocess import InProcessUpstream

SALT = derive_tenant_salt(b"bench", "tenant")
Run = Callable[[list[int], int], Awaitable[tuple[float, int]]]  # -> (ttft_s, tokens)


def _body(model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


def engine_runner(engine: AsyncEngineClient) -> Run:
    async def run(prompt: list[int], max_tokens: int) -> tuple[float, int]:
        start, ttft, tokens = time.perf_counter(), 0.0, 0
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        request = GenerationRequest(uuid.uuid4().hex, tuple(prompt), sampling, SALT)
        async for chunk in engine.generate(request):
            ttft = ttft or time.perf_counter() - start
            tokens = chunk.completion_tokens
        return ttft, tokens

    return run


def upstream_runner(upstream: Upstream, model: str) -> Run:
    async def run(prompt: list[int], max_tokens: int) -> tuple[float, int]:
        start, ttft, tokens = time.perf_counter(), 0.0, 0
        request = UpstreamRequest(
            uuid.uuid4().hex, "completion", model, _body(model, prompt, max_tokens), SALT
        )
        async for item in upstream.stream(request):
            if isinstance(item, UpstreamDelta):
                ttft = ttft or time.perf_counter() - start
            else:
                tokens = item.completion_tokens
        return ttft, tokens

    return run


def http_runner(client: httpx.AsyncClient, model: str) -> Run:
    async def run(prompt: list[int], max_tokens: int) -> tuple[float, int]:
        start, ttft, tokens = time.perf_counter(), 0.0, 0
        body = {
            **_body(model, prompt, max_tokens),
            "stream": True,
            "stream_options": {"include_usage": True},
            "cache_salt": SALT.hex(),
        }
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            async for data in aiter_sse_data(resp.aiter_lines()):
                if data == "[DONE]":
                    continue
                event = json.loads(data)
                if event["choices"]:
                    ttft = ttft or time.perf_counter() - start
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
        return ttft, tokens

    return run


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def burst(run: Run, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    start = time.perf_counter()
    results = await asyncio.gather(*(run(p, max_tokens) for p in prompts))
    wall = time.perf_counter() - start
    ttfts = [r[0] * 1000 for r in results]
    return {
        "output_tokens_per_s": round(sum(r[1] for r in results) / wall, 1),
        "ttft_p50_ms": round(_pct(ttfts, 0.5), 2),
        "ttft_p99_ms": round(_pct(ttfts, 0.99), 2),
        "wall_s": round(wall, 3),
    }


async def serial(runners: dict[str, Run], prompt: list[int], count: int) -> dict[str, Any]:
    """``count`` one-token requests per path, paths interleaved in rounds of 10 so
    that load from other processes hits every path alike; wall and CPU per request."""
    wall: dict[str, list[float]] = {name: [] for name in runners}
    cpu: dict[str, float] = dict.fromkeys(runners, 0.0)
    for _ in range(max(1, count // 10)):
        for name, run in runners.items():
            for _ in range(10):
                start, cpu_start = time.perf_counter(), time.process_time()
                await run(prompt, 1)
                wall[name].append((time.perf_counter() - start) * 1000)
                cpu[name] += time.process_time() - cpu_start
    return {
        name: {
            "latency_p50_ms": round(statistics.median(values), 3),
            "latency_p99_ms": round(_pct(values, 0.99), 3),
            "cpu_ms_per_request": round(cpu[name] * 1000 / len(values), 3),
        }
        for name, values in wall.items()
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    engine = build_engine(
        EngineConfig.tiny(num_kv_blocks=1024, max_model_len=512)
        if args.model == TINY_MODEL
        else EngineConfig(model=args.model)
    )
    rng = random.Random(0)
    vocab = 200
    prompts = [
        [rng.randrange(3, vocab) for _ in range(rng.randint(16, 96))] for _ in range(args.requests)
    ]
    model = engine.model_name
    out: dict[str, Any] = {
        "model": model,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "serial_requests": args.serial,
    }
    try:
        async with serve_in_background(build_worker_app(engine)) as url:
            client = httpx.AsyncClient(base_url=url, timeout=600)
            http_up = HttpUpstream(HttpUpstreamConfig(url))
            runners: dict[str, Run] = {
                "engine": engine_runner(engine),
                "inprocess": upstream_runner(InProcessUpstream(engine), model),
                "worker_http": http_runner(client, model),
                "http_upstream": upstream_runner(http_up, model),
            }
            await burst(runners["engine"], prompts[:4], 4)  # warm-up
            for name, run in runners.items():
                # fresh prompts per path so no path profits from another's prefix cache
                prompts = [[(t + 7) % vocab + 3 for t in p] for p in prompts]
                out[name] = {"burst": await burst(run, prompts, args.max_tokens)}
            for name, figures in (await serial(runners, prompts[0][:16], args.serial)).items():
                out[name]["serial"] = figures
            base = out["engine"]["serial"]
            out["added_per_request"] = {
                name: {
                    "latency_p50_ms": round(
                        out[name]["serial"]["latency_p50_ms"] - base["latency_p50_ms"], 3
                    ),
                    "cpu_ms": round(
                        out[name]["serial"]["cpu_ms_per_request"] - base["cpu_ms_per_request"], 3
                    ),
                }
                for name in runners
                if name != "engine"
            }
            await client.aclose()
            await http_up.aclose()
    finally:
        engine.shutdown()
    return out


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=TINY_MODEL)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--serial", type=int, default=100)
    return parser.parse_args()


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(_args())), indent=2))
