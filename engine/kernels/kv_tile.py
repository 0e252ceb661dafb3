"""Triton helpers shared by the attention kernels: load one K or V tile from the pool.

A float cache is read as is (widened to float32 under the interpreter for bf16); an
int8 cache is dequantized with its per-(slot, KV head) float32 scales, stored in
``[num_blocks, BLOCK_SIZE, Hkv]`` so a row's scale sits at ``row_offset // HEAD_DIM``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_kv_tile(  # type: ignore[no-untyped-def]  # triton-typed
    cache_ptr,
    scale_ptr,
    rows,
    valid,
    HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr,
    KV_INT8: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """[len(rows), HEAD_DIM] tile; ``rows`` are element offsets of each token's head row."""
    offs_d = tl.arange(0, HEAD_DIM)
    ptrs = cache_ptr + rows[:, None] + offs_d[None, :]
    x = tl.load(ptrs, mask=valid[:, None], other=0) if MASKED else tl.load(ptrs)
    if KV_INT8:
        if MASKED:
            scale = tl.load(scale_ptr + rows // HEAD_DIM, mask=valid, other=0.0)
        else:
            scale = tl.load(scale_ptr + rows // HEAD_DIM)
        x = x.to(tl.float32) * scale[:, None]
    elif UPCAST:
        x = x.to(tl.float32)
    return x
