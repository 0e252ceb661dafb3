"""Paged attention on CPU in native AVX-512 code: decode rows and prefill chunks read
K/V from the block pool in place, one pass of online softmax each.

The kernels are ``native/cpu_attention.cpp`` (built and loaded by
:mod:`engine.kernels.native_build`), with their launchers: one ctypes call per layer
hands one work item at a time to the OpenMP threads torch's ops run on (a decode row;
a KV head over a tile of :data:`QUERY_TILE` query rows of a prefill chunk, the last
tiles, which see the most keys, first). Here are the checks that go before them: the
kernels trust every index.
Shapes and layout are those of :mod:`engine.kernels.cpu_decode_attention`; q and out
are float32 or bfloat16, read and written in place (a bfloat16 model's q straight out
of its stacked q/k/v projection, rows a wider stride apart; no float32 copies), the
caches float32, bfloat16 or int8, head_dim one of
:data:`engine.kernels.native_build.HEAD_DIMS` and up to ``MAX_GROUP`` query heads per
KV head.

Why: on a Zen 4 EPYC (2 threads, bfloat16) torch's fused CPU attention ran prefill at
~47 GFLOP/s (6.4 ms per layer for 512 causal tokens) and the numba decode kernels at
~24 GFLOP/s, compute-bound with the K/V in cache (see bench/cpu_attention.py).

kernels and launchers (C++, OpenMP) -> public functions
(:func:`native_decode_rows`, :func:`plan_extend`, :func:`native_extend`). The reference
is :mod:`engine.kernels.reference`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.kernels import native_build
from engine.kernels.cpu_decode_attention import (
    DecodeRows,
    cache_arrays,
    check_planned,
    check_tensors,
)

QUERY_TILE = 16  # query rows of a prefill chunk per work item (times the heads of a KV head)
MAX_QUERY_TILE = 64  # an item keeps its rows' state on its thread's stack
# Below this many work items per thread a chunk's tiles are resized so that every thread
# gets the same number (see :func:`balanced_query_tile`).
FEW_ITEMS_PER_THREAD = 4
AMX_HEAD_DIMS = (32, 64)  # the head sizes native_extend's AMX path takes
AMX_CACHES = (torch.bfloat16, torch.int8)  # ... and the caches (int8 rows dequantized)


@functools.lru_cache(maxsize=4096)  # every layer of a step asks for the same chunks
def balanced_query_tile(q_len: int, num_kv_heads: int, threads: int) -> int:
    """Query rows per work item for a chunk of ``q_len`` rows: :data:`QUERY_TILE`, or,
    where that makes few items (tiles x KV heads) and they do not divide evenly over
    the threads, the smallest tile count that does, in tiles as equal as may be. A
    short chunk after a long cached prefix is all items of the same weight: 24 rows
    over 1,048 keys (SmolLM2: 3 KV heads, 2 threads, Zen 4, bfloat16) took 541 us in
    tiles of 16 (3 items of 16 rows, 3 of 8) and 423 us in tiles of 12; 16 rows over
    1,040 keys 372 -> 293 us in tiles of 8; 8 rows 201 -> 168 us in tiles of 4. Chunks
    of 64-512 rows were fastest in tiles of 16, which they keep."""
    tiles = -(-q_len // QUERY_TILE)
    if tiles * num_kv_heads < FEW_ITEMS_PER_THREAD * threads:
        for count in range(tiles, q_len + 1):
            size = -(-q_len // count)
            if (-(-q_len // size) * num_kv_heads) % threads == 0:
                return size
    return -(-q_len // tiles)

Kernel = Callable[..., Any]


def _ptr(a: np.ndarray) -> int:
    return int(a.ctypes.data)


def rows_ok(t: torch.Tensor) -> bool:
    """Whether the kernels read or write ``t`` in place: float32 or bfloat16 on the CPU,
    [T, H, D] with each token's H x D values contiguous and its rows at least that far
    apart (a view of a wider row, such as q in the stacked q/k/v projection)."""
    return (
        t.device.type == "cpu"
        and t.dtype in (torch.float32, torch.bfloat16)
        and t.dim() == 3
        and t.stride(2) == 1
        and t.stride(1) == t.shape[2]
        and (t.shape[0] <= 1 or t.stride(0) >= t.shape[1] * t.shape[2])
    )


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes a row-strided [T, H, D] tensor covers, as [start, end)."""
    extent = (t.shape[0] - 1) * t.stride(0) + t.shape[1] * t.shape[2] if t.numel() else 0
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def check_io(q: torch.Tensor, out: torch.Tensor) -> None:
    """ValueError unless the kernels can read ``q`` and write ``out`` in place
    (:func:`rows_ok`) and they do not overlap (a work item's output row would be
    another's query row)."""
    for name, t in (("q", q), ("out", out)):
        if not rows_ok(t):
            raise ValueError(f"{name}: need a float32 or bfloat16 CPU tensor [T, H, D] "
                             f"with each row's H x D values contiguous, got {t.dtype} "
                             f"on {t.device}, strides {t.stride()}")  # fmt: skip
    (q0, q1), (o0, o1) = _span(q), _span(out)
    if q0 < o1 and o0 < q1:
        raise ValueError("out overlaps q: the kernels write out while other items read q")


def _io(t: torch.Tensor) -> tuple[int, int, int]:
    """A checked q or out as the kernels take it: address, token-row stride (elements),
    whether it holds bfloat16."""
    return t.data_ptr(), t.stride(0), int(t.dtype == torch.bfloat16)


def openmp_threads(num_threads: int | None) -> int:
    """The OpenMP threads a launch runs on: ``num_threads``, default torch's intra-op
    threads (the same runtime's, so one setting governs both)."""
    return num_threads or torch.get_num_threads()


@dataclass(frozen=True)
class NativeKernels:
    """The loaded library and its launchers for each cache dtype."""

    library: native_build.NativeLibrary
    decode: dict[torch.dtype, Kernel]
    extend: dict[torch.dtype, Kernel]

    @property
    def bf16_products(self) -> bool:
        """Whether prefill over a bfloat16 cache can run on bfloat16 dot products here."""
        return self.library.bf16_products

    @property
    def int8_products(self) -> bool:
        """Whether decode over an int8 cache can run on integer dot products here
        (AVX512-VNNI: :func:`native_decode_rows`'s ``int8_products``)."""
        return self.library.int8_products

    @property
    def extend_amx(self) -> bool:
        """Whether prefill over a bfloat16 or int8 cache can run on the AMX tiles here
        (:func:`native_extend`'s ``amx``; head_dim 32 or 64)."""
        return self.library.extend_amx


@functools.cache
def load_native_kernels(cache_dir: Path) -> NativeKernels:
    """Build or load the library (:func:`engine.kernels.native_build.load`) and wrap it.
    Memoised per process like the library: its launchers close over its entry points,
    and every backend of a process can share them."""
    lib = native_build.load(cache_dir)
    return NativeKernels(
        lib,
        {torch.float32: lib.decode_f32, torch.bfloat16: lib.decode_bf16,
         torch.int8: lib.decode_int8},
        {torch.float32: lib.extend_f32, torch.bfloat16: lib.extend_bf16,
         torch.int8: lib.extend_int8},
    )  # fmt: skip


def supports(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the library was built for this head layout."""
    return (
        head_dim in native_build.HEAD_DIMS
        and num_kv_heads > 0
        and num_heads % num_kv_heads == 0
        and 1 <= num_heads // num_kv_heads <= native_build.MAX_GROUP
    )


def _check_layout(q: torch.Tensor, k_cache: torch.Tensor) -> tuple[int, int]:
    """(head_dim, group) of checked tensors, ValueError if the library lacks them."""
    num_heads, head_dim, num_kv_heads = q.shape[1], q.shape[2], k_cache.shape[2]
    if not supports(num_heads, num_kv_heads, head_dim):
        raise ValueError(f"native kernels: {num_heads} query heads over {num_kv_heads} KV "
                         f"heads of head_dim {head_dim} (built for head_dim "
                         f"{native_build.HEAD_DIMS}, 1-{native_build.MAX_GROUP} query "
                         "heads per KV head)")  # fmt: skip
    return head_dim, num_heads // num_kv_heads


def native_decode_rows(
    kernels: NativeKernels,
    rows: DecodeRows,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    num_threads: int | None = None,
    bf16_products: bool = True,
    int8_products: bool = True,
) -> None:
    """Decode attention of the planned rows (``plan_decode_rows``: their indices were
    checked there) of ``q`` into the same rows of ``out`` (float32 or bfloat16 each, read
    and written in place: :func:`check_io`).

    ``bf16_products``: over a bfloat16 cache, a row whose query holds bfloat16 values runs
    on AVX512-BF16 dot products where the library has them, as :func:`native_extend`'s
    items do (products exact, sums in float32, probabilities rounded to bfloat16 for
    P.V); False: float32 products only. ``int8_products``: over an int8 cache, rows run on
    AVX512-VNNI integer dot products where the library has them
    (:attr:`NativeKernels.int8_products`: the query and each tile's P x V-scale
    quantized to int16, products and sums exact in int32; outputs within ~1e-4 of the
    float32 path's); False: the float32 path (values dequantized as read)."""
    check_io(q, out)
    check_planned(rows, q, k_cache, v_cache, out, native=True)
    head_dim, group = _check_layout(q, k_cache)
    if not rows.num_rows:
        return
    k, v = cache_arrays(k_cache, v_cache)
    tables = rows.block_tables  # planned: contiguous int32 [S, B]; int32 lens, int64 rows
    bad = kernels.decode[k_cache.dtype](
        head_dim, group, *_io(q), _ptr(k), _ptr(v), _ptr(tables), tables.shape[1],
        _ptr(rows.seq_lens), _ptr(rows.q_rows), _ptr(rows.seq_ids), rows.num_rows,
        k_cache.shape[1], k_cache.shape[2], float(scale), *_io(out),
        openmp_threads(num_threads),
        int(int8_products if k_cache.dtype == torch.int8 else bf16_products),
    )  # fmt: skip
    if bad:
        raise RuntimeError("native decode kernel refused its arguments")


@dataclass(frozen=True)
class ExtendChunk:
    """One sequence's prefill chunk, checked once per step (see :func:`plan_extend`)."""

    table: np.ndarray  # [blocks of its context] int32 block ids
    seq_len: int  # context after the chunk
    q_len: int  # its query rows, at positions seq_len - q_len .. seq_len - 1
    num_blocks: int  # cache blocks ...
    block_size: int  # ... of this many tokens the ids were checked against


def plan_extend(
    block_table: torch.Tensor, seq_len: int, q_len: int, num_blocks: int, block_size: int
) -> ExtendChunk:
    """Check a chunk of ``q_len`` query rows ending a context of ``seq_len`` tokens whose
    blocks ``block_table`` lists (a row of the step's int32 tables, padded or not)
    against caches of ``num_blocks`` blocks of ``block_size`` tokens (ValueError)."""
    if not 1 <= q_len <= seq_len:
        raise ValueError(f"a chunk of {q_len} query rows ending a {seq_len}-token context")
    need = -(-seq_len // block_size)
    if block_table.dim() != 1 or block_table.dtype != torch.int32 or block_table.shape[0] < need:
        raise ValueError(f"block_table: need >= {need} int32 block ids, got "
                         f"{tuple(block_table.shape)} {block_table.dtype}")  # fmt: skip
    table = np.ascontiguousarray(block_table[:need].numpy())
    if table.min() < 0 or table.max() >= num_blocks:
        raise ValueError("block_table holds block ids outside the cache")
    return ExtendChunk(table, seq_len, q_len, num_blocks, block_size)


def native_extend(
    kernels: NativeKernels,
    chunk: ExtendChunk,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    num_threads: int | None = None,
    query_tile: int | None = None,
    bf16_products: bool = True,
    amx: bool = False,
) -> None:
    """Causal attention of a planned chunk's query rows ``q`` [q_len, H, D] over its
    context (the cached prefix and the chunk's own K/V, already written) into ``out``
    (float32 or bfloat16 each, in place: :func:`check_io`).

    ``bf16_products``: over a bfloat16 cache, a work item whose query rows all hold
    bfloat16 values (a bfloat16 model's) runs on AVX512-BF16 dot products where the
    library has them (:attr:`NativeKernels.bf16_products`): products exact, sums in
    float32, the probabilities rounded to bfloat16 for P.V as torch's bfloat16 flash
    attention rounds them; 1.65-2x faster (the source says where). False: float32
    products only (every value widened exactly). ``amx``: such a chunk (head_dim 32 or
    64), or a bfloat16 model's chunk over an int8 cache (its rows dequantized to bfloat16),
    runs on the AMX tiles where :attr:`NativeKernels.extend_amx` holds: bfloat16 products,
    float32 sums in another order (two exact passes, no online rescaling)."""
    check_io(q, out)
    check_tensors(q, k_cache, v_cache, out, native=True)
    if q.shape[0] != chunk.q_len or (k_cache.shape[0], k_cache.shape[1]) != (
            chunk.num_blocks, chunk.block_size):  # fmt: skip
        raise ValueError(f"q {tuple(q.shape)} and caches {tuple(k_cache.shape)} are not the "
                         f"ones this chunk was planned for")  # fmt: skip
    if query_tile is None:  # items spread evenly over the threads this launch uses
        query_tile = balanced_query_tile(q.shape[0], k_cache.shape[2], openmp_threads(num_threads))
    if not 1 <= query_tile <= MAX_QUERY_TILE:
        raise ValueError(f"query_tile must be in [1, {MAX_QUERY_TILE}], got {query_tile}")
    head_dim, group = _check_layout(q, k_cache)
    tiles = kernels.extend_amx and k_cache.dtype in AMX_CACHES and head_dim in AMX_HEAD_DIMS
    k, v = cache_arrays(k_cache, v_cache)
    bad = kernels.extend[k_cache.dtype](
        head_dim, group, *_io(q), chunk.q_len, _ptr(k), _ptr(v), _ptr(chunk.table),
        chunk.seq_len - chunk.q_len, k_cache.shape[1], k_cache.shape[2], float(scale),
        *_io(out), query_tile, openmp_threads(num_threads),
        2 if amx and tiles else int(bf16_products),
    )  # fmt: skip
    if bad:
        raise RuntimeError("native extend kernel refused its arguments")
