"""Tier 2 KV: shared-tier TTFT, the Mooncake trace over 2 workers, /metrics, decode cost.

Usage (Redis from ``KVTOLL_REDIS_URL`` or ``--redis-url``; keys under a fresh prefix,
deleted at the end)::

    PYTHONPATH=. .venv/bin/python bench/kv_tier.py [--prompt-tokens 2048] [--trace FILE]
        [--requests 41] [--tokens-per-id 32] [--pool-blocks 16] [--tier-mb 256]

Every engine is the real model (bundled SmolLM2-135M GGUF); in (a) and (d) the
engines of this process share one copy of the weights, each with its own KV pool,
tier and step thread ("a worker" there is one such engine), (b) runs worker
processes; the shared tier is the real Redis.

(a) TTFT of a ``--prompt-tokens`` prompt whose prefix only worker A computed, on worker
    B: recompute (tier off) vs shared tier (prefetch from Redis + load), same run,
    medians of 3 (each trial a new prompt; each engine warmed up first).
(b) A Mooncake conversation trace window: the first ``--requests`` requests of the
    first sessions (same leading two hash ids) with 3+ turns, each hash id turned into
    ``--tokens-per-id`` deterministic tokens, prompts cut at 6 ids, 4 output tokens, in
    trace order, one at a time, alternating between 2 real ``kvtoll worker`` processes
    (round robin: the prefix of a conversation's next turn is on the other worker),
    pools of ``--pool-blocks``; three such pairs (tier off, tier 2 only, tier 2 +
    shared) run side by side and take each request in turn
    (:mod:`bench.kv_tier_workers`). Prefix hit ratio (cached / prompt tokens), mean
    TTFT, and the cached tokens each tier served (usage ``kvtoll_tier_cached_tokens``).
(c) ``/metrics`` of each tier of the tiered workers after (b).
(d) Decode throughput when nothing is reused: 8 distinct prompts x 48 tokens on a
    small pool (every block is evicted and written behind) with tier 2 + shared on vs
    off, same run, alternating order, medians of 4 each.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from engine.api import GenerationRequest, SamplingParams
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.factory import LoadedModel, build_llm_engine, load_model
from engine.kv.hashing import TenantSalt
from engine.kv.tier.config import TierConfig

TRACE = Path(__file__).resolve().parents[2] / "shared/data/mooncake_conversation_trace.jsonl"
SALT = TenantSalt(b"bench-tenant-0001")
MIB = 1 << 20


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


def _engine(
    lm: LoadedModel, blocks: int, tier: TierConfig | None, max_len: int = 4096
) -> AsyncEngine:
    cfg = EngineConfig(num_kv_blocks=blocks, max_model_len=max_len, kv_tier=tier,
                       max_num_batched_tokens=512)  # fmt: skip
    return AsyncEngine(build_llm_engine(cfg, lm))


async def _ttft(
    engine: AsyncEngine, prompt: list[int], max_tokens: int = 1
) -> tuple[float, int]:
    """Seconds to the first chunk and the prompt tokens served from a cache."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    req = GenerationRequest(uuid.uuid4().hex, tuple(prompt), sp, SALT)
    t0 = time.perf_counter()
    first: float | None = None
    cached = 0
    async for chunk in engine.generate(req):
        if first is None:
            first = time.perf_counter() - t0
            cached = chunk.cached_tokens
    assert first is not None
    return first, cached


def _drain(*engines: AsyncEngine) -> None:
    for e in engines:
        if e.engine.tier is not None:
            e.engine.tier.writer.drain()


def _tier(mb: int, shared: bool, url: str, prefix: str) -> TierConfig:
    mode = "redis" if shared else "off"
    return TierConfig(host_bytes=mb * MIB, shared=mode, redis_url=url if shared else None,
                      redis_prefix=prefix, timeout_s=1.0)  # fmt: skip


async def part_a(lm: LoadedModel, n_tokens: int, url: str, prefix: str) -> dict[str, Any]:
    blocks = n_tokens // 16 + 16
    a = _engine(lm, blocks, _tier(512, True, url, prefix))
    b_off = _engine(lm, blocks, None)
    b_on = _engine(lm, blocks, _tier(512, True, url, prefix))
    for i, e in enumerate((a, b_off, b_on)):
        await _ttft(e, _tokens(900 + i, 64))  # warm-up (first-use compilation)
    recompute, shared, cached = [], [], []
    for trial in range(3):
        prompt = _tokens(trial, n_tokens)
        await _ttft(a, prompt)
        _drain(a)
        t_off, _ = await _ttft(b_off, prompt)
        t_on, c = await _ttft(b_on, prompt)
        recompute.append(t_off)
        shared.append(t_on)
        cached.append(c)
    for e in (a, b_off, b_on):
        e.shutdown()
    r, s = statistics.median(recompute), statistics.median(shared)
    return {"prompt_tokens": n_tokens, "ttft_recompute_s": round(r, 4),
            "ttft_shared_tier_s": round(s, 4), "shared_over_recompute": round(s / r, 4),
            "cached_tokens_shared": cached, "trials_recompute_s": [round(x, 4) for x in recompute],
            "trials_shared_s": [round(x, 4) for x in shared]}  # fmt: skip


def trace_window(path: Path, n_requests: int, max_ids: int = 6) -> list[list[int]]:
    """Hash-id lists of the bench's trace window (see the module header)."""
    sessions: dict[tuple[int, int], list[tuple[float, list[int]]]] = {}
    with path.open() as f:
        for i, line in enumerate(f):
            if i >= 4000:
                break
            row = json.loads(line)
            ids = [int(x) for x in row["hash_ids"]]
            if len(ids) >= 2:
                sessions.setdefault((ids[0], ids[1]), []).append((float(row["timestamp"]), ids))
    chosen: list[tuple[float, list[int]]] = []
    for turns in sessions.values():
        if len(turns) >= 3 and len(chosen) < n_requests:
            chosen += turns[:4]
    chosen = sorted(chosen[:n_requests], key=lambda t: t[0])
    return [ids[:max_ids] for _, ids in chosen]


def part_b(args: argparse.Namespace, url: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(b) over real worker processes and (c) their tier metrics
    (:mod:`bench.kv_tier_workers`)."""
    from bench.kv_tier_workers import run_trace

    windows = trace_window(args.trace, args.requests)
    prompts = [[t for k in ids for t in _tokens(10_000 + k, args.tokens_per_id)] + [7]
               for ids in windows]  # fmt: skip
    salt = os.urandom(16).hex()  # a tenant no earlier run stored blocks for
    with tempfile.TemporaryDirectory(prefix="kvtoll-bench-") as logdir:
        try:
            out, metrics = run_trace(prompts, args.pool_blocks, args.tier_mb, url, salt, logdir)
        except RuntimeError:
            for log in sorted(Path(logdir).glob("*.log")):
                print(f"--- {log.name}\n{log.read_text()[-2000:]}", file=sys.stderr)
            raise
        finally:
            _cleanup(url, f"kvtoll:kvtier:*:{salt}:")
    out["tokens_per_id"] = args.tokens_per_id
    return out, metrics


async def _decode_rate(engine: AsyncEngine, seed: int) -> float:
    sp = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    reqs = [GenerationRequest(uuid.uuid4().hex, tuple(_tokens(seed * 100 + i, 40)), sp, SALT)
            for i in range(8)]  # fmt: skip

    async def one(r: GenerationRequest) -> int:
        n = 0
        async for c in engine.generate(r):
            n += len(c.token_ids)
        return n

    t0 = time.perf_counter()
    n = sum(await asyncio.gather(*(one(r) for r in reqs)))
    return n / (time.perf_counter() - t0)


async def part_d(lm: LoadedModel, url: str, prefix: str) -> dict[str, Any]:
    off = _engine(lm, 48, None, 1024)
    on = _engine(lm, 48, _tier(64, True, url, f"{prefix}:d"), 1024)
    await _decode_rate(off, 1)
    await _decode_rate(on, 2)
    rates: dict[str, list[float]] = {"off": [], "on": []}
    for trial in range(4):
        order = [("off", off), ("on", on)] if trial % 2 == 0 else [("on", on), ("off", off)]
        for name, e in order:
            rates[name].append(await _decode_rate(e, 10 + trial * 2 + (name == "on")))
    tier = on.engine.tier
    assert tier is not None
    tier.writer.drain()
    written = tier.host.stats.stores
    for e in (off, on):
        e.shutdown()
    r_off, r_on = statistics.median(rates["off"]), statistics.median(rates["on"])
    return {"tokens_per_s_tier_off": round(r_off, 2), "tokens_per_s_tier_on": round(r_on, 2),
            "on_over_off": round(r_on / r_off, 4), "blocks_written_behind": written,
            "trials": {k: [round(x, 2) for x in v] for k, v in rates.items()}}  # fmt: skip


def _cleanup(url: str, prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        for i in range(0, len(keys), 500):
            client.delete(*keys[i : i + 500])
    finally:
        client.close()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    url = args.redis_url or os.environ.get("KVTOLL_REDIS_URL") or ""
    if not url:
        raise SystemExit("error: --redis-url or KVTOLL_REDIS_URL is required")
    prefix = f"kvtoll-bench:{uuid.uuid4().hex[:8]}"
    lm = load_model(EngineConfig()) if set(args.parts) & {"a", "d"} else None
    result: dict[str, Any] = {"model": lm.name if lm else "bundled", "dtype": EngineConfig().dtype}
    try:
        if "a" in args.parts and lm is not None:
            result["a_shared_ttft"] = await part_a(lm, args.prompt_tokens, url, f"{prefix}:a")
        if "b" in args.parts:
            result["b_trace"], result["c_metrics"] = part_b(args, url)
        if "d" in args.parts and lm is not None:
            result["d_decode_no_reuse"] = await part_d(lm, url, prefix)
    finally:
        _cleanup(url, prefix)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--redis-url")
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--requests", type=int, default=41)
    p.add_argument("--tokens-per-id", type=int, default=32)
    p.add_argument("--pool-blocks", type=int, default=16)
    p.add_argument("--tier-mb", type=int, default=256)
    p.add_argument("--parts", default="abd", help="which of a, b (with c), d to run")
    print(json.dumps(asyncio.run(run(p.parse_args())), indent=1))


if __name__ == "__main__":
    main()
