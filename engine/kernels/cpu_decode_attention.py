"""Paged decode attention on CPU, compiled by numba: reads K/V from the block pool in place.

The torch path copies every decode row's context out of the pool into a contiguous
tensor (all K/V, per layer, per step) and then reads the copy again in the attention
matmuls. These kernels walk the block tables themselves, so K and V are each read
once::

    q          [T, H, D] float32      decode row r is q[q_rows[r]], of sequence seq_ids[r]
    k/v_cache  [num_blocks, BLOCK_SIZE, Hkv, D] float32 or bfloat16
    token t of sequence s -> block_tables[s, t // BLOCK_SIZE], offset t % BLOCK_SIZE
    out        [T, H, D]              only the rows q_rows are written

Three stages, one task per decode row in each numba stage; a task walks the row's
blocks once for all its heads (each block is read as one contiguous run), the GROUP =
H / Hkv query heads of a KV head next to each other (GQA)::

    scores [R, H, W] = (q * scale) . K        W = the longest context; -inf past each row's
    probs  [R, H, W] = softmax(scores)        torch (vectorised exp; numba's is scalar)
    out[q_rows]      = probs . V

GROUP, D and Hkv are compile-time constants of each compiled pair (closures of
:func:`_build`): with them the inner loops are fully vectorised, 2x faster than with
runtime bounds; one task per row instead of per (row, KV head) was another 1.2x on
the scores (both measured). numba caches the machine code on disk per shape.
numba has no bfloat16 type: a bfloat16 cache is passed as its 16-bit patterns, and each
token's K (or V) row is widened to float32 as it is read (a bfloat16 is the top half of
a float32, so ``bits << 16`` is exact); the arithmetic is float32 as for a float32
cache. On the engine bench (bfloat16, Xeon with AMX) the torch path's gather and
matmuls were ~36% of the run.

kernels (``_build``) -> launcher (``_check``, ``_check_indices``) -> public function
(:func:`cpu_paged_decode_attention`). The reference is
:func:`engine.kernels.reference.reference_paged_decode`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numba
import numpy as np
import torch

from engine.kernels.cpu_decode_avx2 import Avx2Decode
from engine.kernels.kv_int8 import SCALE_BYTES, row_width
from engine.kernels.numba_threads import numba_launch

Kernel = Callable[..., Any]

CACHE_DTYPES = (torch.float32, torch.bfloat16)


def _build(
    group: int, head_dim: int, num_kv_heads: int, bf16: bool
) -> tuple[Kernel, Kernel]:
    """The scores and weighted-sum kernels for ``group`` query heads per KV head,
    ``head_dim`` and ``num_kv_heads``, all constants of the compiled code; ``bf16``:
    the caches hold bfloat16 bit patterns (int16 arrays) instead of float32.

    The kernels' free variables must stay plain constants: numba's disk cache keys a
    closure by them, and a jitted helper among them (a different object in every
    build) made every build a cache miss that compiled anew (~3 s) and wrote another
    entry."""
    num_heads = group * num_kv_heads

    @numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
    def scores_kernel(  # type: ignore[no-untyped-def]  # numba-typed
        q, k_cache, block_tables, seq_lens, q_rows, seq_ids, scale, scores
    ):
        block_size = k_cache.shape[1]
        width = scores.shape[2]
        for row in numba.prange(q_rows.shape[0]):
            qi, seq = q_rows[row], seq_ids[row]
            length = seq_lens[seq]
            q_scaled = np.empty((num_heads, head_dim), dtype=np.float32)
            for h in range(num_heads):
                for d in range(head_dim):
                    q_scaled[h, d] = q[qi, h, d] * scale
            bits = np.empty(head_dim, dtype=np.uint32)
            widened = bits.view(np.float32)
            for j in range((length + block_size - 1) // block_size):
                block = block_tables[seq, j]
                for t in range(min(block_size, length - j * block_size)):
                    for kv_head in range(num_kv_heads):
                        if bf16:  # widened into ``bits``, read as float32 through ``widened``
                            for d in range(head_dim):
                                bits[d] = (np.uint32(k_cache[block, t, kv_head, d])
                                           & np.uint32(0xFFFF)) << 16  # fmt: skip
                            k_row = widened
                        else:
                            k_row = k_cache[block, t, kv_head]
                        for g in range(group):
                            h = kv_head * group + g
                            acc = np.float32(0.0)
                            for d in range(head_dim):
                                acc += q_scaled[h, d] * k_row[d]
                            scores[row, h, j * block_size + t] = acc
            for h in range(num_heads):
                for t in range(length, width):
                    scores[row, h, t] = -np.inf

    @numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
    def weighted_sum_kernel(  # type: ignore[no-untyped-def]  # numba-typed
        probs, v_cache, block_tables, seq_lens, q_rows, seq_ids, out
    ):
        block_size = v_cache.shape[1]
        for row in numba.prange(q_rows.shape[0]):
            qi, seq = q_rows[row], seq_ids[row]
            length = seq_lens[seq]
            acc = np.zeros((num_heads, head_dim), dtype=np.float32)
            bits = np.empty(head_dim, dtype=np.uint32)
            widened = bits.view(np.float32)
            for j in range((length + block_size - 1) // block_size):
                block = block_tables[seq, j]
                for t in range(min(block_size, length - j * block_size)):
                    for kv_head in range(num_kv_heads):
                        if bf16:
                            for d in range(head_dim):
                                bits[d] = (np.uint32(v_cache[block, t, kv_head, d])
                                           & np.uint32(0xFFFF)) << 16  # fmt: skip
                            v_row = widened
                        else:
                            v_row = v_cache[block, t, kv_head]
                        for g in range(group):
                            h = kv_head * group + g
                            p = probs[row, h, j * block_size + t]
                            for d in range(head_dim):
                                acc[h, d] += p * v_row[d]
            for h in range(num_heads):
                for d in range(head_dim):
                    out[qi, h, d] = acc[h, d]

    return scores_kernel, weighted_sum_kernel


@numba.njit(cache=True)
def _first_bad_index(  # type: ignore[no-untyped-def]  # numba-typed
    num_q, num_blocks, block_size, block_tables, seq_lens, q_rows, seq_ids
):
    """0 if every index the kernels follow is in range, else a code for the first bad one
    (the kernels themselves do not bounds-check)."""
    for r in range(q_rows.shape[0]):
        if q_rows[r] < 0 or q_rows[r] >= num_q:
            return 1
        seq = seq_ids[r]
        if seq < 0 or seq >= seq_lens.shape[0]:
            return 2
        length = seq_lens[seq]
        if length < 1 or length > block_tables.shape[1] * block_size:
            return 3
        for j in range((length + block_size - 1) // block_size):
            if block_tables[seq, j] < 0 or block_tables[seq, j] >= num_blocks:
                return 4
    return 0


_BAD_INDEX = {
    1: "q_rows out of range",
    2: "seq_ids out of range",
    3: "seq_lens must be in [1, max_blocks * block_size]",
    4: "block_tables hold block ids outside the cache",
}


@dataclass
class CpuDecodeKernels:
    """Compiled kernel pairs by (group, head_dim, num_kv_heads, bf16), built on first use
    (numba loads them from its disk cache after the first compile on a machine, ~3 s);
    ``avx2``: the native AVX2 kernel (:mod:`engine.kernels.cpu_decode_avx2`), which
    :func:`decode_rows_attention` runs instead of them for the shapes it is built for."""

    avx2: Avx2Decode | None = None
    _built: dict[tuple[int, int, int, bool], tuple[Kernel, Kernel]] = field(
        default_factory=dict
    )

    def get(
        self, group: int, head_dim: int, num_kv_heads: int, bf16: bool = False
    ) -> tuple[Kernel, Kernel]:
        key = (group, head_dim, num_kv_heads, bf16)
        if key not in self._built:
            self._built[key] = _build(*key)
        return self._built[key]


def check_tensors(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
    native: bool = False,
) -> None:  # fmt: skip
    """ValueError unless a kernel takes these; ``native``: the native kernels' terms: int8
    caches too (rows of head_dim + 4, :mod:`engine.kernels.kv_int8`), q and out left to
    :func:`engine.kernels.cpu_native_attention.check_io`; else contiguous float32 q and
    out."""
    if not native:  # the native kernels check q and out themselves (in place, either dtype)
        for name, t in (("q", q), ("out", out)):
            if t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous():
                raise ValueError(f"{name}: need a contiguous float32 CPU tensor, got "
                                 f"{t.dtype} on {t.device} (contiguous={t.is_contiguous()})")
    dtypes = (*CACHE_DTYPES, torch.int8) if native else CACHE_DTYPES
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if (t.device.type != "cpu" or t.dtype not in dtypes or not t.is_contiguous()
                or t.dtype != k_cache.dtype):
            raise ValueError(f"{name}: need a contiguous "
                             f"{'float32, bfloat16 or int8' if native else 'float32 or bfloat16'} "
                             f"CPU tensor (both caches alike), got {t.dtype} on {t.device} "
                             f"(contiguous={t.is_contiguous()})")  # fmt: skip
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, "
                         f"v_cache {tuple(v_cache.shape)}")
    if out.shape != q.shape:
        raise ValueError(f"out {tuple(out.shape)} != q {tuple(q.shape)}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    width = row_width(head_dim) if k_cache.dtype == torch.int8 else head_dim
    if k_cache.shape[3] != width or num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads over {num_kv_heads} KV heads, "
                         f"head_dim {head_dim} vs cache {k_cache.shape[3]}"
                         + (f" (int8 rows: head_dim + {SCALE_BYTES})" if width != head_dim
                            else ""))  # fmt: skip


def _check_indices(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, q_rows: torch.Tensor,
    seq_ids: torch.Tensor,
) -> None:  # fmt: skip
    for name, t, dtype in (("block_tables", block_tables, torch.int32),
                           ("seq_lens", seq_lens, torch.int32),
                           ("q_rows", q_rows, torch.int64), ("seq_ids", seq_ids, torch.int64)):
        if t.device.type != "cpu" or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"{name}: need a contiguous {dtype} CPU tensor, got {t.dtype}")
    if block_tables.dim() != 2 or seq_lens.shape != (block_tables.shape[0],):
        raise ValueError(f"block_tables {tuple(block_tables.shape)}, "
                         f"seq_lens {tuple(seq_lens.shape)}")
    if q_rows.dim() != 1 or q_rows.shape != seq_ids.shape:
        raise ValueError(f"q_rows {tuple(q_rows.shape)} vs seq_ids {tuple(seq_ids.shape)}")


@dataclass(frozen=True)
class DecodeRows:
    """The decode rows of one step, checked once against the step's block tables (every
    layer of a step reads the same ones), as the arrays the kernels take, with the
    scratch every layer reuses. Build with :func:`plan_decode_rows`. The arrays are
    views of the tensors planned from, which must not change afterwards (the kernels
    trust the indices they were checked with)."""

    num_q: int  # rows of q (and out) the indices were checked against
    num_heads: int
    num_blocks: int  # cache blocks ...
    block_size: int  # ... of this many tokens the block ids were checked against
    q_rows: np.ndarray  # [R] int64 rows of q / out
    seq_ids: np.ndarray  # [R] int64 their sequences
    block_tables: np.ndarray  # [S, max_blocks] int32
    seq_lens: np.ndarray  # [S] int32
    scores: torch.Tensor  # [R, H, longest context] float32 scratch ([0, H, 0] if none)
    probs: torch.Tensor  # the same shape

    @property
    def num_rows(self) -> int:
        return int(self.q_rows.shape[0])


def plan_decode_rows(
    num_q: int,
    num_heads: int,
    num_blocks: int,
    block_size: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    q_rows: torch.Tensor,
    seq_ids: torch.Tensor,
    scratch: bool = True,
) -> DecodeRows:
    """Check decode rows ``q_rows`` of sequences ``seq_ids`` against ``num_q`` query
    rows and caches of ``num_blocks`` blocks of ``block_size`` tokens (ValueError for
    any index out of range: the kernels do not bounds-check) and plan their scratch;
    ``scratch=False``: none (for the native kernels, which keep no scores)."""
    _check_indices(block_tables, seq_lens, q_rows, seq_ids)
    tables, lens = block_tables.numpy(), seq_lens.numpy()
    rows, seqs = q_rows.numpy(), seq_ids.numpy()
    bad = _first_bad_index(num_q, num_blocks, block_size, tables, lens, rows, seqs)
    if bad:
        raise ValueError(_BAD_INDEX[bad])
    width = int(lens[seqs].max()) if rows.shape[0] and scratch else 0
    scores = torch.empty((rows.shape[0] if scratch else 0, num_heads, width), dtype=torch.float32)
    return DecodeRows(num_q, num_heads, num_blocks, block_size, rows, seqs, tables, lens,
                      scores, torch.empty_like(scores))  # fmt: skip


def cache_arrays(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The caches as the kernels take them: numpy arrays, a bfloat16 cache as its 16-bit
    patterns (numpy and numba have no bfloat16)."""
    if k_cache.dtype == torch.bfloat16:
        return k_cache.view(torch.int16).numpy(), v_cache.view(torch.int16).numpy()
    return k_cache.numpy(), v_cache.numpy()


def check_planned(
    rows: DecodeRows, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    out: torch.Tensor,
    native: bool = False,
) -> None:  # fmt: skip
    """ValueError unless the tensors are ones a kernel takes (:func:`check_tensors`) and
    of the shapes ``rows`` were planned (and their indices checked) for."""
    check_tensors(q, k_cache, v_cache, out, native)
    if (q.shape[0], q.shape[1]) != (rows.num_q, rows.num_heads) or (
        k_cache.shape[0], k_cache.shape[1]) != (rows.num_blocks, rows.block_size):
        raise ValueError(f"q {tuple(q.shape)} and caches {tuple(k_cache.shape)} are not the "
                         f"ones these rows were planned for ({rows.num_q} rows of "
                         f"{rows.num_heads} heads, {rows.num_blocks} blocks of "
                         f"{rows.block_size})")  # fmt: skip


def decode_rows_attention(
    rows: DecodeRows,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    *,
    kernels: CpuDecodeKernels,
    num_threads: int | None = None,
) -> None:
    """Decode attention of the planned rows of ``q`` into the same rows of ``out`` (both
    float32 [num_q, H, D]); the caches float32 or bfloat16 of the planned shape. One
    layer's call: only the tensors are checked here, the indices were at planning."""
    check_planned(rows, q, k_cache, v_cache, out)
    if not rows.num_rows:
        return
    avx2 = kernels.avx2
    if avx2 is not None and avx2.supports(q.shape[1] // k_cache.shape[2], q.shape[2]):
        avx2.run(q, k_cache, v_cache, scale, out,
                 (rows.block_tables, rows.seq_lens, rows.q_rows, rows.seq_ids),
                 torch.get_num_threads() if num_threads is None else num_threads)  # fmt: skip
        return
    if rows.scores.shape[0] != rows.num_rows:
        raise ValueError("these rows were planned without scratch (scratch=False)")
    num_kv_heads, head_dim = k_cache.shape[2], q.shape[2]
    bf16 = k_cache.dtype == torch.bfloat16
    scores_kernel, weighted_sum_kernel = kernels.get(q.shape[1] // num_kv_heads, head_dim,
                                                     num_kv_heads, bf16)
    k, v = cache_arrays(k_cache, v_cache)
    with numba_launch(num_threads):
        scores_kernel(q.numpy(), k, rows.block_tables, rows.seq_lens,
                      rows.q_rows, rows.seq_ids, float(scale), rows.scores.numpy())
        torch.softmax(rows.scores, dim=-1, out=rows.probs)
        weighted_sum_kernel(rows.probs.numpy(), v, rows.block_tables,
                            rows.seq_lens, rows.q_rows, rows.seq_ids, out.numpy())


def cpu_paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    kernels: CpuDecodeKernels,
    q_rows: torch.Tensor | None = None,
    seq_ids: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    num_threads: int | None = None,
) -> torch.Tensor:
    """Decode attention of q rows ``q_rows`` (default: all, one per sequence) over the
    paged contexts of sequences ``seq_ids`` (default: ``0..len-1``), written into
    ``out`` (default: a new tensor whose other rows are left uninitialised) and returned.
    ``q`` and ``out`` are float32; the caches float32 or bfloat16.

    ``kernels`` holds the compiled kernels between calls (keep one per backend: a new
    one loads them from numba's disk cache again);
    ``num_threads`` sets numba's threads (default: torch's intra-op threads, so one
    setting governs both). A caller running several layers over the same rows plans
    them once (:func:`plan_decode_rows`) and calls :func:`decode_rows_attention`.
    """
    if q_rows is None:
        q_rows = torch.arange(q.shape[0], dtype=torch.int64)
    if seq_ids is None:
        seq_ids = torch.arange(q_rows.shape[0], dtype=torch.int64)
    if out is None:
        out = torch.empty_like(q)
    check_tensors(q, k_cache, v_cache, out)
    rows = plan_decode_rows(q.shape[0], q.shape[1], k_cache.shape[0], k_cache.shape[1],
                            block_tables, seq_lens, q_rows, seq_ids)  # fmt: skip
    decode_rows_attention(rows, q, k_cache, v_cache, scale, out, kernels=kernels,
                          num_threads=num_threads)  # fmt: skip
    return out
