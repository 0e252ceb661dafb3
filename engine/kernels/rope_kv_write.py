"""Fused RoPE + KV write: rotate q and k at their positions, store k (rotated) and v.

HF ``rotate_half`` convention, with ``cos``/``sin`` tables [max_positions, D] whose two
halves repeat (as :class:`engine.model.rope.RotaryEmbedding` builds them)::

    x = [x1 | x2]  (halves of D)       c, s = cos[pos, :D/2], sin[pos, :D/2]
    rope(x) = [x1 * c - x2 * s | x2 * c + x1 * s]

    q_out[t]                = rope(q[t])           [H, D]
    k_cache[slot // B, slot % B] = rope(k[t]),  v_cache[...] = v[t]   (slot < 0: skipped)

One program per token; arithmetic in float32, results cast to the output dtypes. Saves
the separate rotation kernels and the round trip of rotated k through memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.kv_write import _check_kv_write
from engine.kernels.launch import check_device, next_power_of_2


@triton.jit
def _rope_halves(x_ptr, rows, mask, cos, sin, HALF: tl.constexpr):  # type: ignore[no-untyped-def]  # triton-typed
    offs = tl.arange(0, HALF)
    x1 = tl.load(x_ptr + rows[:, None] + offs[None, :], mask=mask[:, None]).to(tl.float32)
    x2 = tl.load(x_ptr + rows[:, None] + HALF + offs[None, :], mask=mask[:, None]).to(tl.float32)
    return x1 * cos[None, :] - x2 * sin[None, :], x2 * cos[None, :] + x1 * sin[None, :]


@triton.jit
def _rope_kv_write_kernel(  # type: ignore[no-untyped-def]  # triton-typed
    q_ptr,
    k_ptr,
    v_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_cos,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    half_offs = tl.arange(0, HEAD_DIM // 2)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cos = tl.load(cos_ptr + pos * stride_cos + half_offs).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_cos + half_offs).to(tl.float32)

    heads = tl.arange(0, BLOCK_HEADS)
    q_mask = heads < NUM_HEADS
    q1, q2 = _rope_halves(q_ptr, token * stride_qt + heads * stride_qh, q_mask, cos, sin,
                          HEAD_DIM // 2)  # fmt: skip
    out = q_out_ptr + token * stride_ot + heads[:, None] * stride_oh + half_offs[None, :]
    tl.store(out, q1.to(q_out_ptr.dtype.element_ty), mask=q_mask[:, None])
    tl.store(out + HEAD_DIM // 2, q2.to(q_out_ptr.dtype.element_ty), mask=q_mask[:, None])

    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    kv_heads = tl.arange(0, BLOCK_KV_HEADS)
    kv_mask = kv_heads < NUM_KV_HEADS
    k1, k2 = _rope_halves(k_ptr, token * stride_kt + kv_heads * stride_kh, kv_mask, cos, sin,
                          HEAD_DIM // 2)  # fmt: skip
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct
    dst_rows = dst + kv_heads[:, None] * stride_ch + half_offs[None, :]
    cache_ty = k_cache_ptr.dtype.element_ty
    tl.store(k_cache_ptr + dst_rows, k1.to(cache_ty), mask=kv_mask[:, None])
    tl.store(k_cache_ptr + dst_rows + HEAD_DIM // 2, k2.to(cache_ty), mask=kv_mask[:, None])
    full_offs = tl.arange(0, HEAD_DIM)
    v_src = v_ptr + token * stride_vt + kv_heads[:, None] * stride_vh + full_offs[None, :]
    v = tl.load(v_src, mask=kv_mask[:, None])
    v_dst = v_cache_ptr + dst + kv_heads[:, None] * stride_ch + full_offs[None, :]
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=kv_mask[:, None])


def _check_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:  # fmt: skip
    check_device(_rope_kv_write_kernel, q, k, positions, cos, sin)
    if q.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.stride(2) != 1:
        raise ValueError(f"q {tuple(q.shape)}: want [T, H, D] matching k {tuple(k.shape)}")
    if positions.shape != (q.shape[0],) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions {tuple(positions.shape)} {positions.dtype}: want [T] int")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != q.shape[2]:
        raise ValueError(f"cos/sin {tuple(cos.shape)}: want [max_positions, {q.shape[2]}]")
    if not (cos.is_contiguous() and sin.is_contiguous() and positions.is_contiguous()):
        raise ValueError("cos, sin and positions must be contiguous")


def _launch_rope_kv_write(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, slot_mapping: torch.Tensor, positions: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    _check_kv_write(k, v, k_cache, v_cache, slot_mapping)
    _check_rope(q, k, positions, cos, sin)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0:
        return q_out
    _, block_size, num_kv_heads, _ = k_cache.shape
    _rope_kv_write_kernel[(num_tokens,)](
        q, k, v, q_out, k_cache, v_cache, slot_mapping, positions, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), cos.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        BLOCK_HEADS=next_power_of_2(num_heads),
        BLOCK_KV_HEADS=next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
    )  # fmt: skip
    return q_out


def rope_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """Rotate ``q``/``k`` at ``positions``, store rotated k and v at ``slot_mapping``.

    Returns the rotated q ([T, H, D], q's dtype); the caches are updated in place.
    """
    return _launch_rope_kv_write(q, k, v, k_cache, v_cache, slot_mapping, positions, cos, sin)
