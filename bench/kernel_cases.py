"""Benchmark cases for bench/kernels.py and bench/kernel_sweep.py: the head layout, a
paged batch of random K/V, how it is timed and how much work it is."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

Thunk = Callable[[], object]


@dataclass(frozen=True)
class BenchConfig:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    device: str
    smoke: bool


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def time_ms(fn: Thunk, cfg: BenchConfig) -> float:
    """Median milliseconds per call (CUDA events; a wall clock in smoke mode)."""
    if cfg.device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def make_inputs(cfg: BenchConfig, num_seqs: int, prefix: int, new: int, seed: int) -> Any:
    """kernel_peers.PagedInputs: ``num_seqs`` sequences of ``prefix`` cached and ``new``
    query tokens, their blocks scattered through the pool in a random order."""
    from bench.kernel_peers import PagedInputs

    gen = torch.Generator(device=cfg.device).manual_seed(seed)
    context = prefix + new
    per_seq = -(-context // cfg.block_size)
    shape = (num_seqs * per_seq, cfg.block_size, cfg.num_kv_heads, cfg.head_dim)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=gen, device=cfg.device, dtype=cfg.dtype)

    order = torch.randperm(num_seqs * per_seq, generator=gen, device=cfg.device)
    qsl = torch.arange(num_seqs + 1, device=cfg.device, dtype=torch.int32) * new
    return PagedInputs(
        q=randn(num_seqs * new, cfg.num_heads, cfg.head_dim),
        k_cache=randn(*shape),
        v_cache=randn(*shape),
        block_tables=order.view(num_seqs, per_seq).to(torch.int32),
        seq_lens=torch.full((num_seqs,), context, dtype=torch.int32, device=cfg.device),
        query_start_loc=qsl,
        query_len=new,
        context_len=context,
    )


def kv_read_bytes(cfg: BenchConfig, batch: int, context: int, elem: int) -> int:
    """K and V bytes a decode step reads: every context token of every KV head."""
    return 2 * batch * context * cfg.num_kv_heads * cfg.head_dim * elem


def prefill_flops(cfg: BenchConfig, num_seqs: int, prefix: int, new: int) -> int:
    """4 * H * D per attended (query, key) pair: new tokens over the prefix and causally
    over themselves."""
    pairs = num_seqs * (new * prefix + new * (new + 1) // 2)
    return 4 * cfg.num_heads * cfg.head_dim * pairs
