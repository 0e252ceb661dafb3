"""The CPU attention backend's start-up races (:class:`engine.attention.cpu_backend.
CpuAttentionBackend`): which of two ways to run attention is faster on this machine,
timed on probe shapes of the model's own layout over random caches.

Here: the native kernels' bfloat16 dot-product paths against their float32 products,
decode and prefill each, over a bfloat16 cache (AVX512-BF16 CPUs). Which wins depends on
the core: on Zen 4 a vdpbf16ps does twice an FMA's multiply-adds (both paths won: decode
probe 0.143 vs 0.185 ms, prefill 0.191 vs 0.302), on an AMX Xeon's AVX-512 units no more
(an earlier dot-product decode measured 0.93-0.98x, the prefill path 0.80-0.92x).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from engine.kernels.cpu_decode_attention import plan_decode_rows
from engine.kernels.cpu_native_attention import (
    NativeKernels,
    native_decode_rows,
    native_extend,
    plan_extend,
)
from engine.kernels.kv_int8 import head_dim_of, quantize_rows
from engine.timing import interleaved_best

log = logging.getLogger(__name__)

# The race between the native prefill kernel and torch's fused attention (and between
# prefill's two native paths): this many query rows after this many cached tokens.
PREFILL_PROBE = (64, 192)
PREFILL_TRIALS = 3  # each race: best of this many per side, after a warm-up call
# Decode's two native paths: this many rows over this many tokens each.
DECODE_PRODUCTS_PROBE = (16, 384)


def race(what: str, fns: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Interleaved best of PREFILL_TRIALS seconds per function (after a warm-up call
    each), logged."""
    best = interleaved_best(fns, PREFILL_TRIALS)
    log.info("cpu attention: %s probe %s", what,
             ", ".join(f"{name} {t * 1e3:.3f} ms" for name, t in best.items()))  # fmt: skip
    return best


def _products_win(what: str, run: Callable[[bool], object]) -> bool:
    """Race ``run(bf16_products)`` with bfloat16 dot products against float32 ones."""
    best = race(what, {"products": lambda: run(True), "float32": lambda: run(False)})
    return best["products"] <= best["float32"]


def random_caches(
    blocks: int, like: torch.Tensor, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches of ``blocks`` blocks shaped as ``like``'s, random normal in ``dtype``."""
    _, block_size, num_kv_heads, head_dim = like.shape
    k, v = (torch.randn((blocks, block_size, num_kv_heads, head_dim), generator=gen).to(dtype)
            for _ in range(2))  # fmt: skip
    return k, v


def decode_products_win(native: NativeKernels, num_heads: int, k_cache: torch.Tensor) -> bool:
    """Race decode over the model's cache on dot products (bfloat16 ones over a bfloat16
    cache, VNNI integer ones over an int8 cache) against float32 products
    (DECODE_PRODUCTS_PROBE rows of the model's shape)."""
    _, block_size, num_kv_heads = k_cache.shape[:3]
    head_dim = head_dim_of(k_cache)
    rows, context = DECODE_PRODUCTS_PROBE
    per_row = -(-context // block_size)
    gen = torch.Generator().manual_seed(0)
    int8 = k_cache.dtype == torch.int8
    like = torch.empty((0, block_size, num_kv_heads, head_dim))
    kc, vc = random_caches(rows * per_row, like, torch.bfloat16, gen)
    if int8:
        kc, vc = quantize_rows(kc), quantize_rows(vc)
    q = torch.randn((rows, num_heads, head_dim), generator=gen).to(torch.bfloat16)
    out = torch.empty_like(q)
    tables = torch.arange(rows * per_row, dtype=torch.int32).view(rows, per_row)
    index = torch.arange(rows, dtype=torch.int64)
    plan = plan_decode_rows(rows, num_heads, rows * per_row, block_size, tables,
                            torch.full((rows,), context, dtype=torch.int32), index, index,
                            scratch=False)  # fmt: skip
    return _products_win(f"decode {'int8' if int8 else 'bfloat16'}-products",
                         lambda products: native_decode_rows(
        native, plan, q, kc, vc, 0.125, out, bf16_products=products,
        int8_products=products))  # fmt: skip


def extend_products_win(native: NativeKernels, num_heads: int, k_cache: torch.Tensor) -> bool:
    """Race prefill over a bfloat16 cache on bfloat16 dot products against float32
    products (a PREFILL_PROBE chunk of the model's shape)."""
    return _products_win("prefill bfloat16-products", _extend_probe(
        native, num_heads, k_cache, lambda products: {"bf16_products": products}))


def extend_amx_wins(
    native: NativeKernels, num_heads: int, k_cache: torch.Tensor, products: bool
) -> bool:
    """Race prefill over a bfloat16 or int8 cache (``k_cache``'s dtype) on the AMX tiles
    against the AVX-512 path (``products``: the one extend_products_win picked over a
    bfloat16 cache), a PREFILL_PROBE chunk."""
    run = _extend_probe(native, num_heads, k_cache,
                        lambda amx: {"bf16_products": products, "amx": amx})  # fmt: skip
    best = race("prefill AMX", {"tiles": lambda: run(True), "vectors": lambda: run(False)})
    return best["tiles"] <= best["vectors"]


def _extend_probe(
    native: NativeKernels,
    num_heads: int,
    k_cache: torch.Tensor,
    options: Callable[[bool], dict[str, bool]],
) -> Callable[[bool], object]:
    """``run(flag)``: one PREFILL_PROBE chunk of the model's shape over a random cache
    of ``k_cache``'s dtype (bfloat16, or int8 rows quantized from bfloat16 ones) through
    native_extend with ``options(flag)``."""
    _, block_size, num_kv_heads = k_cache.shape[:3]
    head_dim = head_dim_of(k_cache)
    q_len, cached = PREFILL_PROBE
    seq_len = q_len + cached
    blocks = -(-seq_len // block_size)
    gen = torch.Generator().manual_seed(0)
    like = torch.empty((0, block_size, num_kv_heads, head_dim))
    kc, vc = random_caches(blocks, like, torch.bfloat16, gen)
    if k_cache.dtype == torch.int8:
        kc, vc = quantize_rows(kc), quantize_rows(vc)
    q = torch.randn((q_len, num_heads, head_dim), generator=gen).to(torch.bfloat16)
    out = torch.empty_like(q)
    chunk = plan_extend(torch.arange(blocks, dtype=torch.int32), seq_len, q_len, blocks,
                        block_size)  # fmt: skip
    return lambda flag: native_extend(native, chunk, q, kc, vc, 0.125, out, **options(flag))
