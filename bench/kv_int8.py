"""The int8 KV cache (``kv_cache_dtype="int8"``) against the model's own dtype (a
benchmark, not a test), in-process, bfloat16 model, both in the same run:

* throughput: :mod:`bench.engine_throughput`'s 64 requests (greedy, EOS ignored), the
  two caches interleaved ``--rounds`` times at the same ``kv_cache_bytes``; output
  tokens/s, and the seconds spent in decode attention (the part the cache's bytes
  bound);
* prefix hits at a fixed KV budget: ``--prefixes`` distinct shared prefixes of
  ``--prefix-tokens`` tokens, each request one of them (uniformly at random, seeded)
  plus a few tokens of its own, sent in batches of ``--batch``; with ``--budget-mb``
  of KV cache the bf16 pool holds about half of them, the int8 pool about all. Reports
  the share of prompt tokens served from the prefix cache and the wall time;
* quality: greedy token agreement with the bf16 cache on the first ``--requests``
  workload requests, and perplexity on a held-in text fed through the engine's own
  runner in 128-token chunks (each chunk attends to the cached K/V of the ones before,
  so every token after the first chunk reads quantized K/V).

    python -m bench.kv_int8 [--rounds 2] [--budget-mb 100] [--out FILE]
"""

from __future__ import annotations

import argparse
import math
import os
import random
import time
from typing import Any

import torch

import engine.attention.cpu_backend as cpu_backend
from bench.emit import emit
from bench.engine_peers import cpu_description
from bench.engine_quant import agreement, greedy_tokens, held_in_ids
from bench.engine_throughput import make_workload, run_engine
from engine.api import GenerationRequest, SamplingParams
from engine.config import EngineConfig
from engine.factory import LoadedModel, build_llm_engine, load_model
from engine.runner import RunnerSeq

KV = ("auto", "int8")


def base_config(**overrides: Any) -> EngineConfig:
    fields: dict[str, Any] = dict(dtype="bfloat16", kv_cache_bytes=2 << 30, max_num_seqs=64,
                                  max_num_batched_tokens=512, max_model_len=2048)  # fmt: skip
    fields.update(overrides)
    return EngineConfig(**fields)


class DecodeTimer:
    """Seconds in the CPU backend's decode attention (patched around the class method)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._orig = cpu_backend.CpuAttentionBackend._decode_rows

    def __enter__(self) -> DecodeTimer:
        orig, timer = self._orig, self

        def timed(*args: Any, **kwargs: Any) -> None:
            start = time.perf_counter()
            orig(*args, **kwargs)
            timer.seconds += time.perf_counter() - start

        cpu_backend.CpuAttentionBackend._decode_rows = timed  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        cpu_backend.CpuAttentionBackend._decode_rows = self._orig  # type: ignore[method-assign]


def throughput(loaded: LoadedModel, rounds: int) -> dict[str, Any]:
    work = make_workload(64, (32, 512), (32, 256), seed=0)
    runs: dict[str, list[dict[str, Any]]] = {kv: [] for kv in KV}
    for _ in range(rounds):
        for kv in KV:
            with DecodeTimer() as timer:
                result = run_engine(loaded, base_config(kv_cache_dtype=kv), work)
            result["decode_attention_s"] = round(timer.seconds, 2)
            runs[kv].append(result)
    best = {kv: max(r["output_tokens_per_s"] for r in runs[kv]) for kv in KV}
    pairs = [b["output_tokens_per_s"] / a["output_tokens_per_s"]
             for a, b in zip(runs["auto"], runs["int8"], strict=True)]  # fmt: skip
    return {
        "requests": 64,
        "runs": runs,
        "best_output_tokens_per_s": best,
        "int8_over_bf16_best": round(best["int8"] / best["auto"], 3),
        "int8_over_bf16_pairs": [round(p, 3) for p in pairs],
        "decode_attention_s_min": {kv: min(r["decode_attention_s"] for r in runs[kv]) for kv in KV},
    }


def prefix_hits(loaded: LoadedModel, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(100, 40_000) for _ in range(args.prefix_tokens)]
                for _ in range(args.prefixes)]  # fmt: skip
    picks = [rng.randrange(args.prefixes) for _ in range(args.prefix_requests)]
    prompts = [prefixes[p] + [rng.randrange(100, 40_000) for _ in range(8)] for p in picks]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    out: dict[str, Any] = {
        "prefixes": args.prefixes, "prefix_tokens": args.prefix_tokens,
        "requests": len(prompts), "batch": args.batch, "kv_cache_mb": args.budget_mb,
    }  # fmt: skip
    for kv in KV:
        engine = build_llm_engine(base_config(kv_cache_bytes=args.budget_mb << 20,
                                              kv_cache_dtype=kv), loaded)  # fmt: skip
        prompt_tokens = cached = 0
        start = time.perf_counter()
        for a in range(0, len(prompts), args.batch):
            reqs = [GenerationRequest(f"p{i}", tuple(prompts[i]), params)
                    for i in range(a, min(a + args.batch, len(prompts)))]  # fmt: skip
            for chunks in engine.generate_sync(reqs).values():
                last = chunks[0][-1]
                prompt_tokens += last.prompt_tokens
                cached += last.cached_tokens
        out[kv] = {
            "kv_blocks": engine.runner.num_blocks,
            "cached_prompt_token_share": round(cached / prompt_tokens, 4),
            "seconds": round(time.perf_counter() - start, 2),
        }
    out["int8_blocks_over_bf16"] = round(out["int8"]["kv_blocks"] / out["auto"]["kv_blocks"], 3)
    return out


def engine_perplexity(loaded: LoadedModel, kv: str, ids: list[int], chunk: int = 128) -> float:
    """Perplexity of ``ids`` through the engine's runner, ``chunk`` tokens a step after
    the K/V of the ones before (the cache's dtype is what later tokens attend to)."""
    engine = build_llm_engine(base_config(kv_cache_bytes=256 << 20, kv_cache_dtype=kv), loaded)
    runner = engine.runner
    block_ids = tuple(range(-(-len(ids) // runner.block_size)))
    nll, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, chunk):
            piece = ids[start : start + chunk]
            seq = RunnerSeq(tuple(piece), start, block_ids, True)
            input_ids, positions, meta, _ = runner.build([seq])
            hidden = runner.model(input_ids, positions, runner.rope, runner.kv_caches, meta,
                                  runner.backend, runner.fused)  # fmt: skip
            logits = runner.model.compute_logits(hidden).float()
            targets = torch.tensor(ids[start + 1 : start + 1 + len(piece)])
            logits = logits[: targets.shape[0]]
            nll += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
            count += targets.shape[0]
    return math.exp(nll / count)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=16, help="agreement: workload requests")
    ap.add_argument("--ppl-tokens", type=int, default=1024)
    ap.add_argument("--prefixes", type=int, default=24)
    ap.add_argument("--prefix-tokens", type=int, default=448)
    ap.add_argument("--prefix-requests", type=int, default=96)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--budget-mb", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--out", default="", help="also write the JSON object here")
    args = ap.parse_args()
    loaded = load_model(base_config())
    work = make_workload(64, (32, 512), (32, 256), seed=0)
    prompts, outs = work.prompts[: args.requests], work.max_tokens[: args.requests]
    tokens = {kv: greedy_tokens(loaded, base_config(kv_cache_dtype=kv), prompts, outs) for kv in KV}
    ids = held_in_ids(loaded, args.ppl_tokens)
    ppl = {kv: engine_perplexity(loaded, kv, ids) for kv in KV}
    result: dict[str, Any] = {
        "cpu": cpu_description(),
        "load_average": list(os.getloadavg()),
        "label": "int8 KV cache (per token and head, symmetric, float32 scale) vs the bf16 cache",
        "token_agreement_with_bf16_cache": agreement(tokens["auto"], tokens["int8"]),
        "perplexity": {"tokens": len(ids), "bf16_cache": round(ppl["auto"], 4),
                       "int8_cache": round(ppl["int8"], 4),
                       "change": round(ppl["int8"] / ppl["auto"] - 1, 5)},
        "prefix_hits_at_fixed_budget": prefix_hits(loaded, args),
    }  # fmt: skip
    if not args.skip_throughput:
        result["throughput"] = throughput(loaded, args.rounds)
    emit(result, args.out)


if __name__ == "__main__":
    main()
