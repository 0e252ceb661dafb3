"""KV write into an int8 cache with float32 scales per token slot and KV head.

::

    x = k[t, h, :] (float)          scale = max(|x|) / 127  (1e-8 if x == 0)
    k_cache[block, offset, h, :] = round_half_away(x / scale)  in [-127, 127], int8
    k_scales[block, offset, h]   = scale                       (block, offset from slot)

Each slot owns its scale, so writes never requantize neighbours and a partly filled
block needs no bookkeeping; the attention kernels dequantize as they load (pass
:class:`engine.kernels.launch.KVScales`). One program per token, slot < 0 skipped.
Halves the bytes decode reads vs fp16/bf16 (plus 4 bytes per head row for the scale).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.launch import (
    KVScales,
    check_device,
    check_dtype,
    check_int8_scales,
    next_power_of_2,
)

QMAX = 127.0


@triton.jit
def _quantize_store(  # type: ignore[no-untyped-def]  # triton-typed
    src_ptr, cache_ptr, scale_ptr, src_rows, dst_rows, mask, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    offs_d = tl.arange(0, HEAD_DIM)
    x = tl.load(src_ptr + src_rows[:, None] + offs_d[None, :], mask=mask[:, None], other=0.0)
    x = x.to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 1) / 127.0, 1e-8)
    y = x / scale[:, None]
    y = tl.where(y >= 0, tl.floor(y + 0.5), -tl.floor(0.5 - y))
    y = tl.minimum(tl.maximum(y, -127.0), 127.0)
    tl.store(cache_ptr + dst_rows[:, None] + offs_d[None, :], y.to(tl.int8), mask=mask[:, None])
    tl.store(scale_ptr + dst_rows // HEAD_DIM, scale, mask=mask)


@triton.jit
def _kv_write_int8_kernel(  # type: ignore[no-untyped-def]  # triton-typed
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ct,
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, BLOCK_KV_HEADS)
    mask = heads < NUM_KV_HEADS
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + heads * stride_ch
    _quantize_store(k_ptr, k_cache_ptr, k_scale_ptr, token * stride_kt + heads * stride_kh, dst,
                    mask, HEAD_DIM)  # fmt: skip
    _quantize_store(v_ptr, v_cache_ptr, v_scale_ptr, token * stride_vt + heads * stride_vh, dst,
                    mask, HEAD_DIM)  # fmt: skip


def _launch_kv_write_int8(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    scales: KVScales, slot_mapping: torch.Tensor,
) -> None:  # fmt: skip
    check_device(_kv_write_int8_kernel, k, v, k_cache, v_cache, scales.k, scales.v, slot_mapping)
    check_dtype("k", k)
    check_dtype("v", v)
    check_int8_scales(k_cache, v_cache, scales)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if k.dim() != 3 or k.shape != v.shape or tuple(k.shape[1:]) != (num_kv_heads, head_dim):
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)} must be [T, {num_kv_heads}, "
                         f"{head_dim}]")  # fmt: skip
    if k.stride(-1) != 1 or v.stride(-1) != 1 or not slot_mapping.is_contiguous():
        raise ValueError("k and v need a unit stride in head_dim; slot_mapping contiguous")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)}: want [{k.shape[0]}]")
    if k.shape[0] == 0:
        return
    _kv_write_int8_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, scales.k, scales.v, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        BLOCK_KV_HEADS=next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
    )  # fmt: skip


def allocate_int8_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, KVScales]:
    """Zeroed int8 K and V pools with their (unit) scales."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.zeros(shape, dtype=torch.int8, device=device)
    v_cache = torch.zeros(shape, dtype=torch.int8, device=device)
    ones = torch.ones(shape[:3], dtype=torch.float32, device=device)
    return k_cache, v_cache, KVScales(ones, ones.clone())


def write_kv_int8(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scales: KVScales,
    slot_mapping: torch.Tensor,
) -> None:
    """Quantize ``k``/``v`` ([T, Hkv, D], float) into the int8 caches and their scales."""
    _launch_kv_write_int8(k, v, k_cache, v_cache, scales, slot_mapping)
