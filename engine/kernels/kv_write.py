"""KV write: store the new tokens' K/V into the paged cache at ``slot_mapping``.

::

    k, v        [T, Hkv, D]                     (row t = new token t)
    k_cache     [num_blocks, BLOCK_SIZE, Hkv, D]
    slot        = slot_mapping[t] = block * BLOCK_SIZE + offset;  slot < 0 -> skipped
    k_cache[block, offset] = k[t]

One program per token copies its [Hkv, D] tile for K and for V (cast to the cache dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.launch import check_device, check_dtype, next_power_of_2


@triton.jit
def _kv_write_kernel(  # type: ignore[no-untyped-def]  # triton-typed
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
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
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_KV_HEADS)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = (offs_h < NUM_KV_HEADS)[:, None]
    src_k = k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    dst = block * stride_cb + offset * stride_ct + offs_h[:, None] * stride_ch + offs_d[None, :]
    k = tl.load(src_k, mask=mask)
    v = tl.load(src_v, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _check_kv_write(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    check_device(_kv_write_kernel, k, v, k_cache, v_cache, slot_mapping)
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_dtype(name, t)
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} must match")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    _, _, num_kv_heads, head_dim = k_cache.shape
    if k.dim() != 3 or k.shape != v.shape or tuple(k.shape[1:]) != (num_kv_heads, head_dim):
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)} must be [T, {num_kv_heads}, "
                         f"{head_dim}]")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v need a unit stride in head_dim")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} {slot_mapping.dtype}: "
                         f"want [{k.shape[0]}] int32/int64")
    if not slot_mapping.is_contiguous():
        raise ValueError("slot_mapping must be contiguous")
    if head_dim & (head_dim - 1):
        raise ValueError(f"head_dim={head_dim} must be a power of two")


def _launch_kv_write(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    _check_kv_write(k, v, k_cache, v_cache, slot_mapping)
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    _kv_write_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        BLOCK_KV_HEADS=next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
    )


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``k``/``v`` ([T, Hkv, D]) at ``slot_mapping`` in the caches, in place.

    Slots below zero (padding tokens) are skipped; values are cast to the cache dtype.
    """
    _launch_kv_write(k, v, k_cache, v_cache, slot_mapping)
