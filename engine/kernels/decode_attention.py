"""Paged decode attention with grouped-query heads and split-K ("flash decoding").

Each sequence has one query token per head; its context (``seq_lens[s]`` tokens,
this step's token included) lives in cache blocks listed by its block table::

    q            [S, H, D]            H = Hkv * GROUP (query heads of KV head h are
                                      h*GROUP .. h*GROUP+GROUP-1)
    k/v_cache    [num_blocks, BLOCK_SIZE, Hkv, D]
    token t of seq s -> block_tables[s, t // BLOCK_SIZE], offset t % BLOCK_SIZE

Stage 1, grid (S, Hkv, num_splits): each sequence's own context is cut into
``num_splits`` ranges of ``cdiv(seq_len, num_splits)`` tokens rounded up to BLOCK_N, so
a short sequence beside a long one is split as finely as its length allows and
nothing on the host depends on the lengths (a CUDA graph replays the launch for any
lengths; see :mod:`engine.decode_graphs`). One program loads the GROUP query heads of
one KV head together (padded to BLOCK_H rows, so K/V tiles are read once per group)
and runs an online softmax over its range in BLOCK_N-token tiles, writing the
normalised partial output and its log-sum-exp (base 2)::

    part_out [S, H, num_splits, D] float32      part_lse [S, H, num_splits] float32

Stage 2, grid (S, H): merges the splits, ``out = sum_i 2^(lse_i - m) o_i /
sum_i 2^(lse_i - m)`` with ``m = max_i lse_i``; empty splits have lse = -inf.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.kv_tile import load_kv_tile
from engine.kernels.launch import (
    DEFAULT_LAUNCH,
    KVScales,
    LaunchOptions,
    check_device,
    check_kv_cache,
    check_power_of_two,
    dot_precision,
    next_power_of_2,
    upcast_inputs,
)

LOG2_E = 1.4426950408889634
DEFAULT_BLOCK_N = 64
MAX_SPLITS = 64
MIN_TOKENS_PER_SPLIT = 256
TARGET_PROGRAMS = 264  # ~2 waves of an H100's 132 SMs


@triton.jit
def _decode_tile(  # type: ignore[no-untyped-def]  # triton-typed
    q,
    acc,
    m_i,
    l_i,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    table_ptr,
    tile,
    end,
    kv_head_off,
    qk_scale,
    stride_cb,
    stride_ct,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KV_INT8: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online-softmax update of (acc, m, l) with context tokens [tile, tile+BLOCK_N) < end."""
    offs_n = tile + tl.arange(0, BLOCK_N)
    valid = offs_n < end
    block_ids = tl.load(table_ptr + offs_n // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    rows = block_ids * stride_cb + (offs_n % BLOCK_SIZE) * stride_ct + kv_head_off
    k = load_kv_tile(k_cache_ptr, k_scale_ptr, rows, valid, HEAD_DIM, True, KV_INT8, UPCAST)
    v = load_kv_tile(v_cache_ptr, v_scale_ptr, rows, valid, HEAD_DIM, True, KV_INT8, UPCAST)
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    pv = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit
def _decode_split_kernel(  # type: ignore[no-untyped-def]  # triton-typed
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    part_out_ptr,
    part_lse_ptr,
    qk_scale,
    num_splits,
    stride_qs,
    stride_qh,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_bts,
    stride_pos,
    stride_poh,
    stride_posp,
    stride_pls,
    stride_plh,
    GROUP_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KV_INT8: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    tokens_per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    head_mask = offs_h < GROUP_SIZE
    heads = kv_head * GROUP_SIZE + offs_h
    q_ptrs = q_ptr + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=head_mask[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bts
    for tile in range(start, end, BLOCK_N):
        acc, m_i, l_i = _decode_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table_ptr,
            tile, end, kv_head * stride_ch, qk_scale, stride_cb, stride_ct,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, KV_INT8, UPCAST, DOT_PRECISION,
        )  # fmt: skip

    nonempty = l_i > 0.0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    po_ptrs = (
        part_out_ptr
        + seq.to(tl.int64) * stride_pos
        + heads[:, None] * stride_poh
        + split * stride_posp
        + offs_d[None, :]
    )
    tl.store(po_ptrs, out, mask=head_mask[:, None])
    pl_ptrs = part_lse_ptr + seq.to(tl.int64) * stride_pls + heads * stride_plh + split
    tl.store(pl_ptrs, lse, mask=head_mask)


@triton.jit
def _decode_reduce_kernel(  # type: ignore[no-untyped-def]  # triton-typed
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    num_splits,
    stride_pos,
    stride_poh,
    stride_posp,
    stride_pls,
    stride_plh,
    stride_os,
    stride_oh,
    BLOCK_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_sp = tl.arange(0, BLOCK_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM)
    split_mask = offs_sp < num_splits
    lse = tl.load(
        part_lse_ptr + seq * stride_pls + head * stride_plh + offs_sp,
        mask=split_mask,
        other=float("-inf"),
    )
    m = tl.max(lse, 0)
    weights = tl.where(lse > float("-inf"), tl.exp2(lse - m), 0.0)
    po_ptrs = (
        part_out_ptr
        + seq * stride_pos
        + head * stride_poh
        + offs_sp[:, None] * stride_posp
        + offs_d[None, :]
    )
    parts = tl.load(po_ptrs, mask=split_mask[:, None], other=0.0)
    out = tl.sum(parts * weights[:, None], 0) / tl.sum(weights, 0)
    out_ptrs = out_ptr + seq * stride_os + head * stride_oh + offs_d
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty))


def _check_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_scales: KVScales | None,
    block_n: int,
) -> None:
    check_device(_decode_split_kernel, q, k_cache, v_cache, block_tables, seq_lens)
    check_kv_cache(q, k_cache, v_cache, kv_scales)
    check_power_of_two("block_n", block_n, 16)
    num_seqs = q.shape[0]
    if seq_lens.shape != (num_seqs,) or seq_lens.dtype != torch.int32:
        raise ValueError(
            f"seq_lens {tuple(seq_lens.shape)} {seq_lens.dtype}: want [{num_seqs}] int32"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables {tuple(block_tables.shape)}: want [{num_seqs}, max_blocks]")
    if block_tables.dtype != torch.int32 or block_tables.stride(1) != 1:
        raise ValueError("block_tables must be int32 with a unit stride per row")


def default_num_warps(dtype: torch.dtype, head_dim: int) -> int:
    """Warps per split program: 8 for float32 at head_dim > 64, else 4.

    Compiled for sm_80 and sm_90 (``bench/kernel_compile.py``): float32 at head_dim 128
    with 4 warps spilled on sm_80 (68 LDL/STL); with 8, an int8 cache under bf16 spilled
    on sm_90 (4); these choices spill nowhere.
    """
    return 8 if dtype == torch.float32 and head_dim > 64 else 4


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, block_n: int) -> int:
    """Splits per sequence: enough programs to fill the GPU, each with a long enough range."""
    per_split_cap = max(1, triton.cdiv(max_seq_len, max(MIN_TOKENS_PER_SPLIT, block_n)))
    wanted = max(1, triton.cdiv(TARGET_PROGRAMS, num_seqs * num_kv_heads))
    return int(min(wanted, per_split_cap, MAX_SPLITS))


def _launch_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    block_n: int,
    kv_scales: KVScales | None,
    launch: LaunchOptions,
) -> torch.Tensor:
    _check_decode(q, k_cache, v_cache, block_tables, seq_lens, kv_scales, block_n)
    k_scale, v_scale = (kv_scales.k, kv_scales.v) if kv_scales else (k_cache, v_cache)
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group_size = num_heads // num_kv_heads
    part_out = torch.empty(
        (num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
    )
    part_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype, device=q.device)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, part_out, part_lse,
        scale * LOG2_E, num_splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        GROUP_SIZE=group_size,
        BLOCK_H=max(16, next_power_of_2(group_size)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        KV_INT8=kv_scales is not None,
        UPCAST=upcast_inputs(_decode_split_kernel, q.dtype),
        DOT_PRECISION=dot_precision(q.dtype),
        **launch.kwargs(default_num_warps(q.dtype, head_dim)),
    )  # fmt: skip
    _decode_reduce_kernel[(num_seqs, num_heads)](
        part_out, part_lse, out, num_splits,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        BLOCK_SPLITS=next_power_of_2(num_splits),
        HEAD_DIM=head_dim,
    )  # fmt: skip
    return out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    num_splits: int | None = None,
    block_n: int = DEFAULT_BLOCK_N,
    kv_scales: KVScales | None = None,
    launch: LaunchOptions = DEFAULT_LAUNCH,
) -> torch.Tensor:
    """One query token per sequence over its paged context: returns [S, H, D].

    ``max_seq_len`` (a Python int >= every ``seq_lens``; an upper bound such as the
    model's context length is fine) picks the split count without a device sync;
    ``num_splits`` overrides the heuristic of :func:`choose_num_splits`. With
    ``kv_scales`` the caches are int8 (see :class:`engine.kernels.launch.KVScales`).
    ``launch`` sets the split kernel's warps and pipeline stages.
    """
    if num_splits is None:
        num_splits = choose_num_splits(q.shape[0], k_cache.shape[2], max_seq_len, block_n)
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be >= 1")
    if q.shape[0] == 0:
        return torch.empty_like(q)
    return _launch_decode(
        q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, block_n, kv_scales,
        launch,
    )  # fmt: skip
