"""Paged decode attention on CPUs with AVX2 and FMA but no AVX-512
(``native/cpu_decode_avx2.cpp``), where the AVX-512 kernels of
:mod:`engine.kernels.cpu_native_attention` do not build.

There decode rows ran through numba's three stages (:mod:`engine.kernels.cpu_decode_attention`:
scores, a torch softmax, the weighted sum), compute-bound at ~48 GFLOP/s on a 2-core AVX2
EPYC: SmolLM2-135M's shape, 64 rows of 350 tokens, one layer 2.14 ms over a float32 cache
and 2.22 ms over a bfloat16 one. This kernel reads each token's K and V row once per KV
head for the group's query heads, with an exact softmax in between; the caller plans and
checks the rows as for numba (:func:`engine.kernels.cpu_decode_attention.plan_decode_rows`)
and :func:`engine.kernels.cpu_decode_attention.decode_rows_attention` runs it in numba's
place where :class:`engine.kernels.cpu_decode_attention.CpuDecodeKernels` holds it.

q and out are float32 (a bfloat16 engine passes float32 copies, as to numba); the cache
float32 or bfloat16 (widened exactly). Outputs are float32-close to the reference (its exp
is a polynomial within ~2 ulp of expf), and a row's output does not depend on the other
rows or the thread count.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.kernels import native_build

log = logging.getLogger(__name__)
SOURCE = native_build.SOURCE.with_name("cpu_decode_avx2.cpp")
FLAGS = ("-fopenmp",)


@dataclass(frozen=True)
class Avx2Decode:
    """The loaded library's launcher."""

    path: Path
    _rows: Callable[..., int]
    _head_dim_ok: Callable[[int], int]
    max_group: int

    def supports(self, group: int, head_dim: int) -> bool:
        """Whether the library is built for ``group`` query heads per KV head of ``head_dim``."""
        return 1 <= group <= self.max_group and bool(self._head_dim_ok(head_dim))

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        out: torch.Tensor,
        indices: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
        threads: int,
    ) -> None:
        """Decode attention of rows ``q_rows`` of ``q`` (sequences ``seq_ids``) into the
        same rows of ``out`` (float32 [num_q, H, D], contiguous), over float32 or bfloat16
        caches; ``indices``: (block_tables int32 [S, max_blocks], seq_lens int32 [S],
        q_rows int64 [R], seq_ids int64 [R]), C-contiguous numpy arrays. The caller has
        checked the tensors and every index (the kernel does not bounds-check):
        :func:`engine.kernels.cpu_decode_attention.decode_rows_attention` runs it on rows
        planned by :func:`engine.kernels.cpu_decode_attention.plan_decode_rows`."""
        num_kv_heads, head_dim = k_cache.shape[2], q.shape[2]
        group = q.shape[1] // num_kv_heads
        if not self.supports(group, head_dim):
            raise ValueError(f"the AVX2 decode kernel is not built for {group} query heads "
                             f"per KV head of head_dim {head_dim}")  # fmt: skip
        tables, lens, q_rows, seq_ids = indices
        if self._rows(head_dim, group, q.data_ptr(), q.stride(0), k_cache.data_ptr(),
                      v_cache.data_ptr(), int(k_cache.dtype == torch.bfloat16),
                      tables.ctypes.data, tables.strides[0] // tables.itemsize,
                      lens.ctypes.data, q_rows.ctypes.data, seq_ids.ctypes.data,
                      q_rows.shape[0], k_cache.shape[1], num_kv_heads, float(scale),
                      out.data_ptr(), max(1, threads)):  # fmt: skip
            raise ValueError("the AVX2 decode kernel refused the call")


@functools.cache
def load_avx2_decode(cache_dir: Path) -> Avx2Decode:
    """Build (first use on a machine, a few seconds) and load the library from
    ``cache_dir``; RuntimeError if it cannot be built here (no AVX2/FMA, no compiler)."""
    path = native_build.build(cache_dir, SOURCE, FLAGS, required=native_build.AVX2_CPU_FLAGS)
    lib = ctypes.CDLL(str(path))  # after torch (imported above): its libgomp is the one used
    i32, i64, ptr, f32 = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    fn = lib.kvt_avx2_decode_rows
    fn.argtypes = [i32, i32, ptr, i64, ptr, ptr, i32, ptr, i64, ptr, ptr, ptr, i32, i32, i32,
                   f32, ptr, i32]  # fmt: skip
    fn.restype = i32
    head_dim_ok = lib.kvt_avx2_head_dim_ok
    head_dim_ok.argtypes = [i32]
    head_dim_ok.restype = i32
    return Avx2Decode(path, fn, head_dim_ok, int(lib.kvt_avx2_max_group()))


def avx2_decode_here(cache_dir: Path | None = None) -> tuple[Avx2Decode | None, str | None]:
    """The kernel, or None and why not (this CPU lacks AVX2/FMA, no compiler, a failed
    build); ``cache_dir``: default :func:`engine.kernels.native_build.default_cache_dir`."""
    reason = native_build.unavailable_reason(required=native_build.AVX2_CPU_FLAGS)
    if reason is not None:
        return None, reason
    try:
        return load_avx2_decode(cache_dir or native_build.default_cache_dir()), None
    except (RuntimeError, OSError) as exc:
        return None, str(exc)


def avx2_decode_for(group: int, head_dim: int, cache_dir: Path | None = None) -> Avx2Decode | None:
    """The kernel where it builds here and is built for ``group`` query heads per KV head of
    ``head_dim``, else None (numba's stages decode); either outcome logged."""
    avx2, reason = avx2_decode_here(cache_dir)
    if avx2 is not None and not avx2.supports(group, head_dim):
        avx2, reason = None, f"not built for group {group}, head_dim {head_dim}"
    if avx2 is None:
        log.warning("cpu attention: AVX2 decode kernel unavailable (%s); numba decode kernels",
                    reason)  # fmt: skip
    else:
        log.info("cpu attention: AVX2 decode kernel (%s); prefill in torch", avx2.path.name)
    return avx2
