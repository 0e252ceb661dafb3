"""The int8 KV cache layout for CPU engines (``kv_cache_dtype="int8"``): per token and
KV head, symmetric int8 with its own float32 scale, stored in the same row.

A cache is ``[num_blocks, block_size, num_kv_heads, head_dim + 4]`` int8: each head's
row is ``head_dim`` int8 values ``q`` and then the 4 bytes of a float32 ``scale``, with
``x ~ q * scale``. The scale travels with its values, so the layer's two caches stay a
(K, V) pair of plain tensors and whole-block copies (the KV tier, prefix reuse) carry
the scales with them. Half of bfloat16's bytes plus 4 per row: 0.53x at head_dim 64.

Quantization, per row: ``amax = max |x|``, ``scale = amax / 127``,
``q = round_half_even(x * (127 / amax))`` (0 for an all-zero row), all in float32.
The native writer (``cpu_fused.cpp``'s ``rope_kv_int8``) computes the same operations,
so :func:`quantize_rows` is its bit-exact reference; the native attention kernels
(``cpu_attention.cpp``) dequantize as they read, or, in decode on AVX512-VNNI CPUs,
multiply the int8 values as integers and apply the scales to the sums.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # a row's float32 scale, after its int8 values
KV_CACHE_DTYPES = ("auto", "int8")  # auto: the model's dtype


def row_width(head_dim: int) -> int:
    """Bytes of one head's row in an int8 cache."""
    return head_dim + SCALE_BYTES


def head_dim_of(cache: torch.Tensor) -> int:
    """The head_dim a cache [blocks, block_size, Hkv, width] holds (int8: width - 4)."""
    width = int(cache.shape[-1])
    return width - SCALE_BYTES if cache.dtype == torch.int8 else width


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` [..., D] (float32 or bfloat16) as int8 rows [..., D + 4] with their scales."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = amax / 127.0
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xf * inv).clamp_(-127, 127).to(torch.int8)
    scale_bytes = scale.contiguous().view(torch.int8)  # [..., 4]: the float32's bytes
    return torch.cat((q, scale_bytes), dim=-1)


def dequantize_rows(rows: torch.Tensor) -> torch.Tensor:
    """int8 rows [..., D + 4] back to float32 [..., D]."""
    if rows.dtype != torch.int8:
        raise ValueError(f"int8 rows expected, got {rows.dtype}")
    values = rows[..., :-SCALE_BYTES].float()
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)  # [..., 1]
    return values * scale
