"""How close the int8-linear path (``linear_quant="int8"``) stays to bfloat16 (a
benchmark, not a test):

* token agreement: the first ``--requests`` requests of
  :mod:`bench.engine_throughput`'s workload, greedy, EOS ignored, through the engine
  in each mode; per request the share of output tokens before the first difference,
  and how many requests are identical throughout;
* perplexity on a held-in text (questions from ``/work/shared/data/qqp_pairs_12k.jsonl``,
  joined, the first ``--ppl-tokens`` tokens), computed with Hugging Face's Llama
  forward on the same weights in bfloat16, and again with its linear layers replaced
  by the same int8 layers (:func:`engine.model.int8_linear.quantize_linears`, on the
  native kernel where it builds, as the engine's).

    python -m bench.engine_quant [--requests 16] [--ppl-tokens 1024] [--dtype float32]

``--dtype``: the unquantized model's (default bfloat16; float32 where the CPU has no
bfloat16 instructions, e.g. AVX2 only, and the int8 inputs are then rounded to int16 by
:mod:`engine.kernels.cpu_gemm_avx2`'s kernel).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

import torch

from bench.engine_peers import cpu_description
from bench.engine_throughput import hf_model, make_workload
from engine.api import GenerationRequest, SamplingParams
from engine.config import EngineConfig
from engine.factory import LoadedModel, build_llm_engine, load_model
from engine.kernels.cpu_gemm_avx2 import Avx2Int8Gemm
from engine.model.int8_linear import NativeInt8Linear, native_int8_kernel, quantize_linears

HELD_IN = Path("/work/shared/data/qqp_pairs_12k.jsonl")


def greedy_tokens(loaded: LoadedModel, config: EngineConfig,
                  prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:  # fmt: skip
    engine = build_llm_engine(config, loaded)
    reqs = [
        GenerationRequest(
            f"r{i}", tuple(p), SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
        )
        for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))
    ]
    out = engine.generate_sync(reqs)
    return [[t for c in out[f"r{i}"][0] for t in c.token_ids] for i in range(len(reqs))]


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    shares = []
    for x, y in zip(a, b, strict=True):
        n = next((i for i, (s, t) in enumerate(zip(x, y, strict=True)) if s != t), len(x))
        shares.append(n / len(x))
    same = sum(x == y for x, y in zip(a, b, strict=True))
    positions = sum(s == t for x, y in zip(a, b, strict=True) for s, t in zip(x, y, strict=True))
    return {
        "requests": len(a),
        "identical_requests": same,
        "mean_share_before_first_difference": round(statistics.mean(shares), 4),
        "same_token_at_same_position": round(positions / sum(len(x) for x in a), 4),
    }


def held_in_ids(loaded: LoadedModel, num_tokens: int) -> list[int]:
    lines = HELD_IN.read_text().splitlines()
    text = " ".join(json.loads(line)["text_a"] for line in lines[:400])
    ids = list(loaded.tokenizer.encode(text))
    if len(ids) < num_tokens:
        raise RuntimeError(f"held-in text has only {len(ids)} tokens")
    return ids[:num_tokens]


def perplexity(model: Any, ids: list[int]) -> float:
    x = torch.tensor([ids])
    with torch.inference_mode():
        logits = model(x).logits[0, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits, x[0, 1:])
    return math.exp(nll.item())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--ppl-tokens", type=int, default=1024)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = ap.parse_args()
    work = make_workload(64, (32, 512), (32, 256), seed=0)
    prompts, outs = work.prompts[: args.requests], work.max_tokens[: args.requests]
    base = dict(dtype=args.dtype, kv_cache_bytes=2 << 30, max_num_seqs=64,
                max_num_batched_tokens=512, max_model_len=2048)  # fmt: skip
    plain_cfg = EngineConfig(**base)
    int8_cfg = EngineConfig(**base, linear_quant="int8")
    plain = load_model(plain_cfg)
    tokens_plain = greedy_tokens(plain, plain_cfg, prompts, outs)
    tokens_int8 = greedy_tokens(load_model(int8_cfg), int8_cfg, prompts, outs)
    ids = held_in_ids(plain, args.ppl_tokens)
    hf = hf_model(plain, getattr(torch, args.dtype))
    ppl_plain = perplexity(hf, ids)
    kernel = native_int8_kernel()
    quantize_linears(hf, gemm=kernel)  # as the engine quantizes
    native = any(isinstance(m, NativeInt8Linear) for m in hf.modules())
    ppl_int8 = perplexity(hf, ids)
    inputs = ("per-row int16 inputs, native AVX2 kernel)" if isinstance(kernel, Avx2Int8Gemm)
              else "per-row int8 inputs, native VNNI kernel)")  # fmt: skip
    short = "bf16" if args.dtype == "bfloat16" else args.dtype
    print(json.dumps({
        "cpu": cpu_description(),
        "label": "QUANTIZED: int8 linears (per-channel int8 weights, "
                 + (inputs if native else "per-call uint8 inputs, fbgemm)"),
        f"token_agreement_with_{short}": agreement(tokens_plain, tokens_int8),
        "perplexity": {"held_in_text": f"{HELD_IN.name}: text_a of the first 400 rows",
                       "tokens": len(ids), short: round(ppl_plain, 3),
                       "int8_linears": round(ppl_int8, 3),
                       "change": round(ppl_int8 / ppl_plain - 1, 4)},
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
