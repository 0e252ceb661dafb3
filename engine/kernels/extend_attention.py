"""Prefill / extend attention over a cached prefix, variable lengths in one launch.

Sequence s brings ``q_len = qsl[s+1] - qsl[s]`` new query tokens; its K/V (prefix and
the new tokens, already written) are in the paged cache, ``seq_lens[s]`` tokens long::

    prefix_len = seq_lens[s] - q_len
    query j sits at position prefix_len + j and attends to cache positions <= it

    cache positions  0 ............ prefix_len ........... seq_len
                     [ cached prefix ][  new tokens (this step) ]
    q-block rows                       [BLOCK_M ]...
    loop 1 (no mask) [0, full_end)     full_end = first row's position rounded down to BLOCK_N
    loop 2 (causal)  [full_end, min(last row + 1, seq_len))

Grid (S, cdiv(max_query_len, BLOCK_M), H); programs past their sequence's query
length return at once. A prefix-cache hit therefore costs only the new rows.
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
    upcast_inputs,
)

LOG2_E = 1.4426950408889634
DEFAULT_BLOCK_M = 64
DEFAULT_BLOCK_N = 64
FLOAT32_TILES = (16, 32)


@triton.jit
def _attend_tile(  # type: ignore[no-untyped-def]  # triton-typed
    q,
    acc,
    m_i,
    l_i,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    table_ptr,
    kv_start,
    q_pos,
    seq_len,
    kv_head_off,
    qk_scale,
    stride_cb,
    stride_ct,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    KV_INT8: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online-softmax update with cache positions [kv_start, kv_start + BLOCK_N)."""
    offs_n = kv_start + tl.arange(0, BLOCK_N)
    in_ctx = offs_n < seq_len
    table = table_ptr + offs_n // BLOCK_SIZE
    block_ids = tl.load(table, mask=in_ctx, other=0) if MASKED else tl.load(table)
    rows = block_ids.to(tl.int64) * stride_cb + (offs_n % BLOCK_SIZE) * stride_ct + kv_head_off
    k = load_kv_tile(k_cache_ptr, k_scale_ptr, rows, in_ctx, HEAD_DIM, MASKED, KV_INT8, UPCAST)
    v = load_kv_tile(v_cache_ptr, v_scale_ptr, rows, in_ctx, HEAD_DIM, MASKED, KV_INT8, UPCAST)
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        keep = (offs_n[None, :] <= q_pos[:, None]) & in_ctx[None, :]
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    pv = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    return acc * alpha[:, None] + pv, m_new, l_i


@triton.jit
def _extend_kernel(  # type: ignore[no-untyped-def]  # triton-typed
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    out_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_bts,
    GROUP_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KV_INT8: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    m_block = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len + m_block * BLOCK_M

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_mask = offs_m < q_len
    tokens = q_start.to(tl.int64) + offs_m
    q_ptrs = q_ptr + tokens[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_mask[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = first_pos + tl.arange(0, BLOCK_M)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bts
    kv_head_off = (head // GROUP_SIZE) * stride_ch
    full_end = (first_pos // BLOCK_N) * BLOCK_N
    for kv_start in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table_ptr,
            kv_start, q_pos, seq_len, kv_head_off, qk_scale, stride_cb, stride_ct,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, KV_INT8, UPCAST, DOT_PRECISION,
        )  # fmt: skip
    kv_end = tl.minimum(first_pos + BLOCK_M, seq_len)
    for kv_start in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table_ptr,
            kv_start, q_pos, seq_len, kv_head_off, qk_scale, stride_cb, stride_ct,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, KV_INT8, UPCAST, DOT_PRECISION,
        )  # fmt: skip

    out = acc / l_i[:, None]
    o_ptrs = out_ptr + tokens[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


def _check_extend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    kv_scales: KVScales | None,
) -> None:
    check_device(_extend_kernel, q, k_cache, v_cache, query_start_loc, seq_lens, block_tables)
    check_kv_cache(q, k_cache, v_cache, kv_scales)
    num_seqs = seq_lens.shape[0]
    if seq_lens.dim() != 1 or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens {tuple(seq_lens.shape)} {seq_lens.dtype}: want [S] int32")
    if query_start_loc.shape != (num_seqs + 1,) or query_start_loc.dtype != torch.int32:
        raise ValueError(f"query_start_loc {tuple(query_start_loc.shape)} "
                         f"{query_start_loc.dtype}: want [{num_seqs + 1}] int32")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables {tuple(block_tables.shape)}: want [{num_seqs}, max_blocks]")
    if block_tables.dtype != torch.int32 or block_tables.stride(1) != 1:
        raise ValueError("block_tables must be int32 with a unit stride per row")


def _launch_extend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    block_m: int,
    block_n: int,
    kv_scales: KVScales | None,
    launch: LaunchOptions,
) -> torch.Tensor:
    _check_extend(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, kv_scales)
    k_scale, v_scale = (kv_scales.k, kv_scales.v) if kv_scales else (k_cache, v_cache)
    check_power_of_two("block_m", block_m, 16)
    check_power_of_two("block_n", block_n, 16)
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or max_query_len == 0:
        return out
    grid = (num_seqs, triton.cdiv(max_query_len, block_m), num_heads)
    _extend_kernel[grid](
        q, k_cache, v_cache, k_scale, v_scale, out, query_start_loc, seq_lens, block_tables,
        scale * LOG2_E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        GROUP_SIZE=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        KV_INT8=kv_scales is not None,
        UPCAST=upcast_inputs(_extend_kernel, q.dtype),
        DOT_PRECISION=dot_precision(q.dtype),
        **launch.kwargs(default_num_warps(head_dim)),
    )  # fmt: skip
    return out


def default_num_warps(head_dim: int) -> int:
    """Warps per program: 8 at head_dim > 64, else 4. Compiled for sm_80, 64 x 64 bf16
    tiles at head_dim 128 spilled with 4 warps (35 LDL/STL), and none with 8."""
    return 8 if head_dim > 64 else 4


def default_tiles(dtype: torch.dtype) -> tuple[int, int]:
    """(block_m, block_n) for queries of ``dtype``.

    bf16/fp16 dots run on the tensor cores (wgmma on Hopper) with no spills at 64 x 64.
    float32 dots run on the FMA units with their tiles in registers: at 64 x 64 a
    head_dim-128 program spilled 8.5 KB to local memory on sm_90 (31,831 LDL/STL in its
    SASS); at 16 x 32 nothing spilled on sm_80 or sm_90 (``bench/kernel_compile.py``).
    """
    if dtype == torch.float32:
        return FLOAT32_TILES
    return DEFAULT_BLOCK_M, DEFAULT_BLOCK_N


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    block_m: int | None = None,
    block_n: int | None = None,
    kv_scales: KVScales | None = None,
    launch: LaunchOptions = DEFAULT_LAUNCH,
) -> torch.Tensor:
    """Causal attention of the new tokens ``q`` ([T, H, D]) over their paged context.

    ``max_query_len`` (a Python int >= every query length) sizes the grid without a
    device sync. With ``kv_scales`` the caches are int8. ``block_m``/``block_n`` default
    to :func:`default_tiles` of q's dtype; ``launch`` sets warps and pipeline stages.
    Returns [T, H, D] in q's dtype.
    """
    tile_m, tile_n = default_tiles(q.dtype)
    return _launch_extend(
        q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale,
        max_query_len, tile_m if block_m is None else block_m,
        tile_n if block_n is None else block_n, kv_scales, launch,
    )  # fmt: skip
