"""Noisy neighbour: does tenant A keep its prefix cache while tenant B floods the worker?

One kvtoll worker (the real worker app over HTTP on localhost, with its engine, in a
process of its own: :mod:`bench.noisy_worker`) serves two tenants, told apart by the
gateway's salts and shares (``cache_salt``, ``kvtoll_kv_share``):

* A repeats requests over a fixed set of long shared prefixes, taken from the Mooncake
  conversation trace's structure (``--trace``: the ``--prefixes`` most common leading
  runs of ``--prefix-hashes`` hash ids; each hash id becomes ``--tokens-per-hash``
  pseudo-random tokens, and each request adds a unique ``--suffix-tokens`` tail), at
  ``--a-rate`` requests/s, the prefixes in the trace's proportions.
* B floods unique ``--b-prompt-tokens`` prompts at ``--b-factor`` times A's rate.

Three phases, each on a fresh worker, each after A sent every prefix once (warm-up, not
measured): ``alone`` (A only), ``flood`` (A + B, no reservation) and ``reserved``
(A + B, A reserved its working set: every prefix's blocks plus a suffix block each).
Reported per phase: A's prefix hit ratio (sum cached_tokens / sum prompt_tokens), A's
TTFT p50/p99, B's completed requests/s and prompt tokens/s, and the worker's per-tenant
counters from ``GET /load``; then the ratios the issue's goals name (reserved vs
alone, reserved vs flood for B). ``--plot FILE.png``: A's hit ratio over time, one line
per phase (matplotlib). Prints one JSON object.

    .venv/bin/python bench/noisy_neighbour.py --plot noisy.png          # tiny model
    .venv/bin/python bench/noisy_neighbour.py --model bundled --kv-cache-mb 100 ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections import Counter
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.noisy_worker import worker_process
from engine.config import TINY_MODEL, EngineConfig
from engine.kv.hashing import TenantSalt, derive_tenant_salt
from kvtoll.openai.sse import aiter_sse_data

DEFAULT_TRACE = Path("/work/shared/data/mooncake_conversation_trace.jsonl")
SALT_A = derive_tenant_salt(b"noisy-neighbour", "tenant-a")
SALT_B = derive_tenant_salt(b"noisy-neighbour", "tenant-b")
PHASES = ("alone", "flood", "reserved")


@dataclass
class Sample:
    at_s: float  # arrival, seconds since the phase started
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float


@dataclass
class PhaseResult:
    a: list[Sample] = field(default_factory=list)
    a_failed: int = 0
    b_done: int = 0
    b_prompt_tokens: int = 0
    b_failed: int = 0
    wall_s: float = 0.0
    tenants: list[dict[str, Any]] = field(default_factory=list)


def trace_prefixes(
    path: Path, num_prefixes: int, prefix_hashes: int
) -> list[tuple[tuple[int, ...], int]]:
    """The ``num_prefixes`` most common leading runs of ``prefix_hashes`` hash ids, with
    how often the trace starts a request with each."""
    counts: Counter[tuple[int, ...]] = Counter()
    with path.open() as f:
        for line in f:
            ids = tuple(json.loads(line)["hash_ids"][:prefix_hashes])
            if len(ids) == prefix_hashes:
                counts[ids] += 1
    return counts.most_common(num_prefixes)


def hash_tokens(hash_id: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(hash_id * 7919 + 1)
    return [rng.randrange(3, vocab) for _ in range(n)]


class Workload:
    """A's prefixes and per-request prompts, B's unique prompts (all seeded)."""

    def __init__(self, args: argparse.Namespace, vocab: int) -> None:
        self.args = args
        self.vocab = vocab
        found = trace_prefixes(Path(args.trace), args.prefixes, args.prefix_hashes)
        self.prefixes = [
            [t for h in ids for t in hash_tokens(h, args.tokens_per_hash, vocab)]
            for ids, _ in found
        ]
        self.weights = [count for _, count in found]
        self.rng = random.Random(args.seed)

    def a_prompt(self) -> list[int]:
        prefix = self.rng.choices(self.prefixes, self.weights)[0]
        return prefix + [self.rng.randrange(3, self.vocab) for _ in range(self.args.suffix_tokens)]

    def b_prompt(self) -> list[int]:
        return [self.rng.randrange(3, self.vocab) for _ in range(self.args.b_prompt_tokens)]

    def working_set_blocks(self, block_size: int) -> int:
        """Blocks A's prefixes fill, plus one request's own blocks per prefix."""
        per_request = -(-(self.args.suffix_tokens + self.args.max_tokens) // block_size) + 1
        return sum(len(p) // block_size + per_request for p in self.prefixes)


def _body(args: argparse.Namespace, model: str, prompt: list[int], salt: TenantSalt,
          tenant: str, reserved: int) -> dict[str, Any]:
    return {
        "model": model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
        "cache_salt": salt.hex(),
        "kvtoll_kv_share": {"tenant": tenant, "reserved_blocks": reserved, "max_blocks": None},
    }


async def _send(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[float, int, int]:
    """(ttft_s, prompt_tokens, cached_tokens) of one streamed completion."""
    start = time.perf_counter()
    ttft = 0.0
    usage: dict[str, Any] = {}
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"worker answered {resp.status_code}: {await resp.aread()!r}")
        async for data in aiter_sse_data(resp.aiter_lines()):
            if data == "[DONE]":
                continue
            event = json.loads(data)
            if event.get("choices") and not ttft:
                ttft = time.perf_counter() - start
            usage = event.get("usage") or usage
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return ttft, int(usage.get("prompt_tokens", 0)), int(cached)


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    common: dict[str, Any] = {
        "max_num_batched_tokens": args.max_batched_tokens,
        "max_num_seqs": args.max_seqs,
        "short_prefill_tokens": args.short_prefill_tokens,
        "fair_scheduling": args.fair_scheduling,
    }
    if args.kv_cache_mb:
        common["kv_cache_bytes"] = args.kv_cache_mb * 2**20
    else:
        common["num_kv_blocks"] = args.num_blocks
    if args.model == TINY_MODEL:
        return EngineConfig.tiny(max_model_len=1024, **common)
    model = None if args.model == "bundled" else args.model
    return EngineConfig(model=model, dtype=args.dtype, max_model_len=4096, **common)


async def run_phase(args: argparse.Namespace, phase: str, workload: Workload,
                    reserved: int) -> PhaseResult:
    result = PhaseResult()
    a_share = reserved if phase == "reserved" else 0
    with worker_process(_engine_config(args)) as (url, model):
        async with AsyncExitStack() as stack:
            client = await stack.enter_async_context(
                # a fresh connection per request: no race with the server's keep-alive
                # timeout closing an idle connection as a request goes out on it
                httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(
                    max_connections=1000, max_keepalive_connections=0)))
            for prefix in workload.prefixes:  # warm-up: every prefix once
                await _send(client, _body(args, model, prefix + [5] * args.suffix_tokens,
                                          SALT_A, "a", a_share))
            t0 = time.perf_counter()
            tasks: list[asyncio.Task[None]] = []

            async def a_request(at: float) -> None:
                body = _body(args, model, workload.a_prompt(), SALT_A, "a", a_share)
                try:
                    ttft, prompt, cached = await _send(client, body)
                except (RuntimeError, httpx.HTTPError):
                    result.a_failed += 1
                    return
                result.a.append(Sample(at, prompt, cached, ttft))

            async def b_request() -> None:
                try:
                    _, prompt, _ = await _send(client, _body(args, model, workload.b_prompt(),
                                                             SALT_B, "b", 0))
                except (RuntimeError, httpx.HTTPError):
                    result.b_failed += 1
                    return
                if time.perf_counter() - t0 <= args.duration:
                    result.b_done += 1
                    result.b_prompt_tokens += prompt

            events = _arrivals(args, phase != "alone")
            for at, who in events:
                await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
                coro = a_request(at) if who == "a" else b_request()
                tasks.append(asyncio.create_task(coro))
            await asyncio.gather(*tasks)
            result.wall_s = time.perf_counter() - t0
            load = (await client.get("/load")).json()
            result.tenants = load.get("tenants", [])
    return result


def _arrivals(args: argparse.Namespace, with_b: bool) -> list[tuple[float, str]]:
    """Open-loop arrival times (seeded Poisson) of A's and, with B, B's requests."""
    rng = random.Random(args.seed + 1)
    events: list[tuple[float, str]] = []
    for who, rate in (("a", args.a_rate), ("b", args.a_rate * args.b_factor if with_b else 0)):
        t = 0.0
        while rate > 0:
            t += rng.expovariate(rate)
            if t >= args.duration:
                break
            events.append((t, who))
    return sorted(events)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def summarize(result: PhaseResult, duration: float) -> dict[str, Any]:
    prompt = sum(s.prompt_tokens for s in result.a)
    ttfts = [s.ttft_s for s in result.a]
    return {
        "a_requests": len(result.a),
        "a_failed": result.a_failed,
        "a_hit_ratio": round(sum(s.cached_tokens for s in result.a) / max(1, prompt), 4),
        "a_ttft_p50_ms": round(1000 * statistics.median(ttfts), 2) if ttfts else None,
        "a_ttft_p99_ms": round(1000 * _pct(ttfts, 0.99), 2),
        "b_requests_per_s": round(result.b_done / duration, 3),
        "b_prompt_tokens_per_s": round(result.b_prompt_tokens / duration, 1),
        "b_failed": result.b_failed,
        "wall_s": round(result.wall_s, 2),
        "worker_tenants": result.tenants,
    }


def plot(results: dict[str, PhaseResult], path: Path, window: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for phase, result in results.items():
        samples = sorted(result.a, key=lambda s: s.at_s)
        xs, ys = [], []
        for i in range(len(samples)):
            part = samples[max(0, i - window + 1): i + 1]
            xs.append(samples[i].at_s)
            cached = sum(s.cached_tokens for s in part)
            ys.append(cached / max(1, sum(s.prompt_tokens for s in part)))
        style = {"alone": ":", "flood": "-", "reserved": "--"}.get(phase, "-")
        ax.plot(xs, ys, style, label=phase, linewidth=2.5 if phase == "alone" else 1.5)
    ax.set_xlabel("time in phase (s)")
    ax.set_ylabel(f"A's prefix hit ratio (last {window} requests)")
    ax.set_ylim(0, 1.05)
    ax.set_title("Tenant A under tenant B's flood of unique prompts")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=TINY_MODEL, help="kvtoll-tiny, bundled, or a path")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-mb", type=int, default=0, help="KV pool size (else --num-blocks)")
    p.add_argument("--num-blocks", type=int, default=200)
    p.add_argument("--max-batched-tokens", type=int, default=256)
    p.add_argument("--max-seqs", type=int, default=32)
    p.add_argument("--short-prefill-tokens", type=int, default=64)
    p.add_argument("--fair-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="engine.tenant_fair (--no-fair-scheduling: arrival order, no "
                        "interjection)")  # fmt: skip
    p.add_argument("--trace", default=str(DEFAULT_TRACE))
    p.add_argument("--prefixes", type=int, default=4)
    p.add_argument("--prefix-hashes", type=int, default=4)
    p.add_argument("--tokens-per-hash", type=int, default=64, help="tokens per trace hash id")
    p.add_argument("--suffix-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--a-rate", type=float, default=4.0, help="A's requests per second")
    p.add_argument("--b-factor", type=float, default=3.0, help="B's rate / A's rate")
    p.add_argument("--b-prompt-tokens", type=int, default=512)
    p.add_argument("--duration", type=float, default=30.0, help="seconds per phase")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default="", help="write A's hit ratio over time to this PNG")
    p.add_argument("--window", type=int, default=10, help="requests per plotted point")
    p.add_argument("--phases", default=",".join(PHASES))
    return p.parse_args(argv)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    config = _engine_config(args)
    vocab = 250 if args.model == TINY_MODEL else 49152
    workload = Workload(args, vocab)
    reserved = workload.working_set_blocks(config.block_size)
    results: dict[str, PhaseResult] = {}
    for phase in args.phases.split(","):
        workload.rng = random.Random(args.seed)  # the same A and B prompts in every phase
        started = time.perf_counter()
        results[phase] = await run_phase(args, phase, workload, reserved)
        print(f"phase {phase}: {len(results[phase].a)} A requests, {results[phase].b_done} B, "
              f"{time.perf_counter() - started:.1f} s with the worker's start",
              file=sys.stderr, flush=True)
    out: dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items() if k != "plot"},
        "a_reserved_blocks": reserved,
        "phases": {p: summarize(r, args.duration) for p, r in results.items()},
    }
    ph = out["phases"]
    for phase in ("flood", "reserved"):
        if {"alone", phase} <= ph.keys():
            out[f"{phase}_vs_alone"] = {
                key: _ratio(ph[phase][key], ph["alone"][key])
                for key in ("a_hit_ratio", "a_ttft_p50_ms", "a_ttft_p99_ms")
            }
    if {"flood", "reserved"} <= ph.keys():
        out["b_throughput_reserved_vs_flood"] = _ratio(
            ph["reserved"]["b_prompt_tokens_per_s"], ph["flood"]["b_prompt_tokens_per_s"]
        )
    if args.plot:
        plot(results, Path(args.plot), args.window)
        out["plot"] = args.plot
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(json.dumps(asyncio.run(main_async(args)), indent=2))


if __name__ == "__main__":
    main()
