"""CPU paged attention: the native AVX-512 kernels vs the numba decode kernel and torch's
fused attention, in the same run (a benchmark, not a test).

Usage::

    .venv/bin/python bench/cpu_attention.py [--dtype bfloat16] [--threads 2]

SmolLM2-135M's attention shape (9 query heads over 3 KV heads, head_dim 64), blocks of
16 tokens scattered over the pool. Decode: 64 rows with the engine bench's context
lengths (32-512 prompt + 0-144 generated), over 30 layers' caches each (as a decode
step reads them: from memory, not cache), native vs numba (scores, softmax, weighted
sum), and in bfloat16, where the CPU has AVX512-BF16, the native kernel with bfloat16
dot products (its default) vs float32 products only (the queries hold values of the
model's dtype, as a model's do). Prefill: one chunk per shape (query rows after cached
tokens; the queries as in decode), native vs the torch backend's path
(gather the context's blocks, then ``scaled_dot_product_attention`` with GQA and a
causal or shifted mask), and in bfloat16, where the CPU has AVX512-BF16, the native
kernel with bfloat16 dot products (its default) vs float32 products only. Decode over
int8 caches (the same tables): the native kernel on VNNI integer products, where the
CPU has AVX512-VNNI, vs its float32 path. Best of
several runs each, interleaved; prints one JSON object with times, GFLOP/s (causal
FLOPs: 4 x head_dim per visible query-key pair per head) and the speed-ups.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from typing import Any

import torch

from engine.attention.base import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.kernels import native_build
from engine.kernels.cpu_decode_attention import (
    CpuDecodeKernels,
    decode_rows_attention,
    plan_decode_rows,
)
from engine.kernels.cpu_native_attention import (
    load_native_kernels,
    native_decode_rows,
    native_extend,
    plan_extend,
)
from engine.kernels.kv_int8 import quantize_rows, row_width
from engine.timing import interleaved_best

H, HKV, D, BLOCK, LAYERS = 9, 3, 64, 16, 30
# (query rows, cached tokens)
PREFILL_SHAPES = [(128, 0), (512, 0), (512, 512), (24, 1024), (64, 1024), (64, 192)]


def scattered_table(blocks: int, pool: int, rng: random.Random) -> torch.Tensor:
    return torch.tensor(rng.sample(range(pool), blocks), dtype=torch.int32)


def decode_tables() -> tuple[list[int], int, torch.Tensor]:
    """The decode bench's 64 context lengths, the pool's block count and the rows' block
    tables (blocks scattered over the pool)."""
    rng = random.Random(0)
    lens = [rng.randint(32, 512) + rng.randint(0, 144) for _ in range(64)]
    blocks = [-(-n // BLOCK) for n in lens]
    pool = sum(blocks) + 16
    order = rng.sample(range(pool), sum(blocks))
    tables = torch.zeros((len(lens), max(blocks)), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = torch.tensor(order[used : used + n], dtype=torch.int32)
        used += n
    return lens, pool, tables


def decode(dtype: torch.dtype, runs: int) -> dict[str, Any]:
    lens, pool, tables = decode_tables()
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    caches = [(torch.randn((pool, BLOCK, HKV, D), generator=gen).to(dtype),
               torch.randn((pool, BLOCK, HKV, D), generator=gen).to(dtype))
              for _ in range(LAYERS)]  # fmt: skip
    q = torch.randn((len(lens), H, D), generator=gen).to(dtype).float()  # a model's queries
    out = torch.empty_like(q)
    rows_idx = torch.arange(len(lens))
    plan = plan_decode_rows(len(lens), H, pool, BLOCK, tables, seq_lens, rows_idx, rows_idx)
    bare = plan_decode_rows(len(lens), H, pool, BLOCK, tables, seq_lens, rows_idx, rows_idx,
                            scratch=False)  # fmt: skip
    numba_kernels = CpuDecodeKernels()
    native = load_native_kernels(native_build.default_cache_dir())

    def run_numba() -> None:
        for k, v in caches:
            decode_rows_attention(plan, q, k, v, D**-0.5, out, kernels=numba_kernels)

    def run_native() -> None:
        for k, v in caches:
            native_decode_rows(native, bare, q, k, v, D**-0.5, out)

    def run_native_f32() -> None:
        for k, v in caches:
            native_decode_rows(native, bare, q, k, v, D**-0.5, out, bf16_products=False)

    fns: dict[str, Callable[[], object]] = {"native": run_native, "numba": run_numba}
    if dtype == torch.bfloat16 and native.bf16_products:  # the native float32-products path
        fns["native_f32_products"] = run_native_f32
    best = interleaved_best(fns, runs)
    flops = 4 * D * H * sum(lens) * LAYERS
    kv_bytes = 2 * sum(lens) * HKV * D * dtype.itemsize * LAYERS
    return {
        "rows": len(lens), "context_tokens": sum(lens), "layers": LAYERS,
        **{f"{name}_ms": round(t * 1e3, 2) for name, t in best.items()},
        **{f"{name}_gflop_per_s": round(flops / t / 1e9, 1) for name, t in best.items()},
        **{f"{name}_kv_gb_per_s": round(kv_bytes / t / 1e9, 1) for name, t in best.items()},
        "native_speedup": round(best["numba"] / best["native"], 2),
        **({"bf16_products_speedup": round(best["native_f32_products"] / best["native"], 2)}
           if "native_f32_products" in best else {}),
    }  # fmt: skip


def decode_int8(runs: int) -> dict[str, Any]:
    """Decode over int8 caches (rows quantized from random normal ones, with their
    scales) of the same shape and tables as :func:`decode`, a bfloat16 model's queries:
    the native kernel on VNNI integer products (where the library has them) vs its
    float32 path."""
    lens, pool, tables = decode_tables()
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    caches = [(quantize_rows(torch.randn((pool, BLOCK, HKV, D), generator=gen)),
               quantize_rows(torch.randn((pool, BLOCK, HKV, D), generator=gen)))
              for _ in range(LAYERS)]  # fmt: skip
    q = torch.randn((len(lens), H, D), generator=gen).to(torch.bfloat16)
    out = torch.empty_like(q)
    rows_idx = torch.arange(len(lens))
    bare = plan_decode_rows(len(lens), H, pool, BLOCK, tables, seq_lens, rows_idx, rows_idx,
                            scratch=False)  # fmt: skip
    native = load_native_kernels(native_build.default_cache_dir())

    def run(products: bool) -> None:
        for k, v in caches:
            native_decode_rows(native, bare, q, k, v, D**-0.5, out, int8_products=products)

    fns: dict[str, Callable[[], object]] = {"native_f32": lambda: run(False)}
    if native.int8_products:
        fns["native_int8_products"] = lambda: run(True)
    best = interleaved_best(fns, runs)
    kv_bytes = 2 * sum(lens) * HKV * row_width(D) * LAYERS
    return {
        "rows": len(lens), "context_tokens": sum(lens), "layers": LAYERS,
        **{f"{name}_ms": round(t * 1e3, 2) for name, t in best.items()},
        **{f"{name}_kv_gb_per_s": round(kv_bytes / t / 1e9, 1) for name, t in best.items()},
        **({"int8_products_speedup": round(best["native_f32"] / best["native_int8_products"], 2)}
           if "native_int8_products" in best else {}),
    }  # fmt: skip


def prefill_case(
    q_len: int, cached: int, dtype: torch.dtype, runs: int, rng: random.Random,
    gen: torch.Generator,
) -> dict[str, Any]:  # fmt: skip
    native = load_native_kernels(native_build.default_cache_dir())
    torch_backend = TorchAttentionBackend(fused_bf16_prefill=True)
    seq_len = q_len + cached
    blocks = -(-seq_len // BLOCK)
    pool = blocks + 64
    table = scattered_table(blocks, pool, rng)
    k = torch.randn((pool, BLOCK, HKV, D), generator=gen).to(dtype)
    v = torch.randn((pool, BLOCK, HKV, D), generator=gen).to(dtype)
    q = torch.randn((q_len, H, D), generator=gen).to(dtype).float()  # a model's queries
    out = torch.empty_like(q)
    chunk = plan_extend(table, seq_len, q_len, pool, BLOCK)
    meta = AttentionMetadata(
        torch.tensor([0, q_len], dtype=torch.int32), torch.tensor([seq_len], dtype=torch.int32),
        table.unsqueeze(0), torch.zeros(q_len, dtype=torch.int64), q_len, seq_len,
        (q_len,), (seq_len,),
    )  # fmt: skip
    qd = q.to(dtype)
    sdpa_chunk = torch_backend._prefill_plan(meta, [0, q_len], BLOCK, qd)[0]
    fns: dict[str, Callable[[], object]] = {
        "native": lambda: native_extend(native, chunk, q, k, v, D**-0.5, out),
        "torch_sdpa": lambda: torch_backend._prefill_one(qd, k, v, sdpa_chunk, D**-0.5),
    }
    if dtype == torch.bfloat16 and native.bf16_products:  # the native float32-products path
        fns["native_f32_products"] = lambda: native_extend(native, chunk, q, k, v, D**-0.5, out,
                                                           bf16_products=False)  # fmt: skip
    best = interleaved_best(fns, runs)
    flops = 4 * D * H * sum(cached + i + 1 for i in range(q_len))
    return {
        "query_rows": q_len, "cached_tokens": cached,
        **{f"{name}_ms": round(t * 1e3, 3) for name, t in best.items()},
        **{f"{name}_gflop_per_s": round(flops / t / 1e9, 1) for name, t in best.items()},
        "native_speedup": round(best["torch_sdpa"] / best["native"], 2),
        **({"bf16_products_speedup": round(best["native_f32_products"] / best["native"], 2)}
           if "native_f32_products" in best else {}),
    }  # fmt: skip


def prefill(dtype: torch.dtype, runs: int) -> list[dict[str, Any]]:
    rng = random.Random(1)
    gen = torch.Generator().manual_seed(1)
    return [prefill_case(q_len, cached, dtype, runs, rng, gen) for q_len, cached in PREFILL_SHAPES]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    reason = native_build.unavailable_reason()
    if reason is not None:
        raise SystemExit(f"native kernels unavailable here: {reason}")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(json.dumps({
        "dtype": args.dtype, "threads": args.threads,
        "decode": decode(dtype, args.runs), "decode_int8_cache": decode_int8(args.runs),
        "prefill": prefill(dtype, args.runs),
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
