"""Peers for bench/kernels.py: the same paged decode / prefill done by torch SDPA on
gathered K/V, FlashAttention (3, else 2) and FlashInfer where importable.

Each ``*_decode`` / ``*_prefill`` returns a zero-argument callable to time, or raises
:class:`PeerUnavailable` with the reason (not installed, unsupported page size...).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

Thunk = Callable[[], object]


class PeerUnavailable(RuntimeError):
    """The peer cannot run here; the message says why."""


@dataclass(frozen=True)
class PagedInputs:
    """One benchmark case over a paged cache (layout of engine.attention.base)."""

    q: torch.Tensor  # [T, H, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [S, blocks_per_seq] int32
    seq_lens: torch.Tensor  # [S] int32
    query_start_loc: torch.Tensor  # [S + 1] int32
    query_len: int  # every sequence brings this many new tokens
    context_len: int  # and has this many after them


def _import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except Exception as exc:  # ImportError, or a broken CUDA extension
        raise PeerUnavailable(f"{name} not importable: {type(exc).__name__}") from exc


def gather_kv(inputs: PagedInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous [S, Hkv, L, D] K/V, gathered through the block tables."""
    tables = inputs.block_tables.long()
    num_seqs = tables.shape[0]
    _, _, num_kv_heads, head_dim = inputs.k_cache.shape

    def one(cache: torch.Tensor) -> torch.Tensor:
        flat = cache[tables].view(num_seqs, -1, num_kv_heads, head_dim)
        return flat[:, : inputs.context_len].transpose(1, 2).contiguous()

    return one(inputs.k_cache), one(inputs.v_cache)


def sdpa_decode(inputs: PagedInputs, include_gather: bool) -> Thunk:
    """torch SDPA on gathered K/V, with or without timing the gather itself."""
    q = inputs.q.unsqueeze(2)  # [S, H, 1, D]
    gathered = gather_kv(inputs)

    def run() -> object:
        k, v = gather_kv(inputs) if include_gather else gathered
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    return run


def sdpa_prefill(inputs: PagedInputs) -> Thunk:
    """torch SDPA (lower-right causal) on pre-gathered K/V, all sequences in one call."""
    from torch.nn.attention.bias import causal_lower_right

    num_seqs = inputs.seq_lens.shape[0]
    q = inputs.q.view(num_seqs, inputs.query_len, *inputs.q.shape[1:]).transpose(1, 2)
    k, v = gather_kv(inputs)
    heads = q.shape[1]
    k = k.repeat_interleave(heads // k.shape[1], dim=1)  # flash kernels want equal heads
    v = v.repeat_interleave(heads // v.shape[1], dim=1)
    bias = causal_lower_right(inputs.query_len, inputs.context_len)
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def flash_attn_decode(inputs: PagedInputs) -> Thunk:
    """FlashAttention-3's paged decode, else FlashAttention-2's (page size % 256 == 0)."""
    q = inputs.q.unsqueeze(1)  # [S, 1, H, D]
    try:
        fa3 = _import("flash_attn_interface")
        return lambda: fa3.flash_attn_with_kvcache(
            q, inputs.k_cache, inputs.v_cache, cache_seqlens=inputs.seq_lens,
            page_table=inputs.block_tables, causal=True,
        )  # fmt: skip
    except PeerUnavailable:
        fa2 = _import("flash_attn")
    if inputs.k_cache.shape[1] % 256:
        raise PeerUnavailable("flash_attn 2 paged KV needs a page size multiple of 256")
    return lambda: fa2.flash_attn_with_kvcache(
        q, inputs.k_cache, inputs.v_cache, cache_seqlens=inputs.seq_lens,
        block_table=inputs.block_tables, causal=True,
    )  # fmt: skip


def _flashinfer_pages(inputs: PagedInputs) -> tuple[torch.Tensor, ...]:
    block_size = inputs.k_cache.shape[1]
    num_seqs, per_seq = inputs.block_tables.shape
    device = inputs.q.device
    indptr = torch.arange(num_seqs + 1, dtype=torch.int32, device=device) * per_seq
    indices = inputs.block_tables.reshape(-1).contiguous()
    last = (inputs.seq_lens - 1) % block_size + 1
    return indptr, indices, last.to(torch.int32)


def flashinfer_decode(inputs: PagedInputs) -> Thunk:
    """FlashInfer's batch decode over the same NHD pages."""
    fi = _import("flashinfer")
    _, block_size, num_kv_heads, head_dim = inputs.k_cache.shape
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=inputs.q.device)
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    indptr, indices, last = _flashinfer_pages(inputs)
    wrapper.plan(
        indptr, indices, last, inputs.q.shape[1], num_kv_heads, head_dim, block_size,
        q_data_type=inputs.q.dtype, kv_data_type=inputs.k_cache.dtype,
    )  # fmt: skip
    return lambda: wrapper.run(inputs.q, (inputs.k_cache, inputs.v_cache))


def flashinfer_prefill(inputs: PagedInputs) -> Thunk:
    """FlashInfer's batch prefill over the same NHD pages (causal, prefix cached)."""
    fi = _import("flashinfer")
    _, block_size, num_kv_heads, head_dim = inputs.k_cache.shape
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=inputs.q.device)
    wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    indptr, indices, last = _flashinfer_pages(inputs)
    wrapper.plan(
        inputs.query_start_loc, indptr, indices, last, inputs.q.shape[1], num_kv_heads,
        head_dim, block_size, causal=True, q_data_type=inputs.q.dtype,
        kv_data_type=inputs.k_cache.dtype,
    )  # fmt: skip
    return lambda: wrapper.run(inputs.q, (inputs.k_cache, inputs.v_cache))
