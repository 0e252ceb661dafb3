"""The Llama decoder's small per-layer ops fused in native AVX-512 code, or AVX2 code where
AVX-512 is missing (CPU, float32 and bfloat16): residual add + RMSNorm, RoPE + the K/V
write into the paged cache, and SiLU(gate) * up, each one pass over its rows
(``native/cpu_fused.cpp``, ``native/cpu_fused_avx2.cpp``, built by
:mod:`engine.kernels.native_build`): they round where eager torch rounds and sum and
exponentiate in torch's own order and algorithm, so they return the eager ops' values
bit for bit (float32 and bfloat16; the source's header says how).

Why: in eager torch these are 3-9 ops each (RMSNorm alone: widen, square, sum, divide,
add, rsqrt, multiply, narrow, multiply), 20-odd small ops per layer and ~700 per
SmolLM2 step, each an allocation, a dispatch and an OpenMP fork over a few thousand
elements. vLLM fuses the same ops by compiling the model with torch inductor.

kernels (C++) -> ctypes entry points (:class:`FusedKernels`) -> public functions that
check shapes, dtypes and strides (the kernels trust them): :func:`add_rmsnorm`,
:func:`rope_write_kv` (after :func:`plan_rope`, once per step) and :func:`silu_mul`.
A call of :data:`PARALLEL_ROWS` rows or more splits them over torch's OpenMP threads
inside the kernel (the pool the linears and attention already keep warm), one thread per
:data:`ROWS_PER_THREAD` rows at most (:func:`row_threads`); fewer run on the calling
thread. The reference for each is the eager torch code it replaces
(tests/engine/kernels/test_cpu_fused.py).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.kernels import native_build
from engine.kernels.kv_int8 import head_dim_of

log = logging.getLogger(__name__)
DTYPES = (torch.float32, torch.bfloat16)
MAX_INT8_HEAD_DIM = 256  # cpu_fused.cpp's MAX_HEAD_DIM (its per-head scratch)
# A call splits its rows over up to one OpenMP thread per ROWS_PER_THREAD rows (so from
# PARALLEL_ROWS rows on), no more than torch's threads. bfloat16 add_rmsnorm of SmolLM2's
# width (576), 2 threads of a Zen 4 EPYC, one thread vs two, us per call: 8 rows 4.3 /
# 4.0, 16 rows 6.8 / 5.3, 64 rows 23.6 / 14.0, 2,048 rows 672 / 359 (the Python thread
# that split halves before cost ~55 us a hand-off, so it split only from 96 rows and
# gained nothing there).
ROWS_PER_THREAD = 8
PARALLEL_ROWS = 2 * ROWS_PER_THREAD


@dataclass(frozen=True)
class FusedKernels:
    """The loaded library's entry points by dtype."""

    path: Path
    add_rmsnorm: dict[torch.dtype, Any]
    rope_kv: dict[torch.dtype, Any]
    rope_kv_int8: dict[torch.dtype, Any]  # by the activations' dtype; int8 caches
    silu_mul: dict[torch.dtype, Any]
    argmax: Any  # float32 rows


def _entries(lib: ctypes.CDLL, name: str, argtypes: list[Any]) -> dict[torch.dtype, Any]:
    out = {}
    for dtype, suffix in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
        fn = getattr(lib, f"kvt_{name}_{suffix}")
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int32
        out[dtype] = fn
    return out


AVX2_SOURCE = native_build.FUSED_SOURCE.with_name("cpu_fused_avx2.cpp")


def _source() -> tuple[Path, frozenset[str]] | str:
    """The source to build here and the CPU flags it needs: the AVX-512 kernels where they
    build, else the AVX2 ones; else why neither can."""
    why_not = native_build.unavailable_reason()
    if why_not is None:
        return native_build.FUSED_SOURCE, native_build.REQUIRED_CPU_FLAGS
    avx2 = native_build.AVX2_CPU_FLAGS
    if native_build.unavailable_reason(required=avx2) is None:
        return AVX2_SOURCE, avx2
    return why_not


def unavailable_reason() -> str | None:
    """None if the fused kernels (AVX-512 or AVX2) can be built here, else why not."""
    found = _source()
    return found if isinstance(found, str) else None


@functools.cache
def load_fused_kernels(cache_dir: Path) -> FusedKernels:
    """Build (first time on a machine, a few seconds) or load the library (the AVX-512
    kernels where they build, else the AVX2 ones: ``native/cpu_fused_avx2.cpp``, the same
    entry points and values); memoised per process. RuntimeError or OSError where neither
    can be built or loaded here."""
    found = _source()
    if isinstance(found, str):
        raise RuntimeError(found)
    source, required = found
    path = native_build.build(cache_dir, source, native_build.FUSED_FLAGS, required=required)
    lib = ctypes.CDLL(str(path))
    i32, i64, f32, ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    # qkv, row stride, rows, heads, kv heads, head_dim, positions, cos, sin, slots, k, v,
    # threads (each entry point's last argument: the OpenMP threads to split rows over)
    rope = [ptr, i64, i32, i32, i32, i32, ptr, ptr, ptr, ptr, ptr, ptr, i32]
    return FusedKernels(
        path,
        # x, x stride, residual, its stride, weight, out, its stride, rows, width, eps, threads
        _entries(lib, "add_rmsnorm", [ptr, i64, ptr, i64, ptr, ptr, i64, i32, i32, f32, i32]),
        _entries(lib, "rope_kv", rope),
        _entries(lib, "rope_kv_int8", rope),
        # gate_up, its stride, out, its stride, rows, width, threads
        _entries(lib, "silu_mul", [ptr, i64, ptr, i64, i32, i32, i32]),
        _entry(lib, "kvt_argmax_rows", [ptr, i64, i32, i32, ptr, i32]),  # x, stride, rows,
        # width, out, threads
    )


def _entry(lib: ctypes.CDLL, name: str, argtypes: list[Any]) -> Any:
    fn = getattr(lib, name)
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int32
    return fn


def fused_kernels_here(cache_dir: Path | None = None) -> FusedKernels | None:
    """The kernels if they build and load here (``cache_dir``: default
    :func:`engine.kernels.native_build.default_cache_dir`), else None, with the reason
    logged: the model then runs its eager torch ops."""
    reason = unavailable_reason()
    if reason is None:
        try:
            return load_fused_kernels(cache_dir or native_build.default_cache_dir())
        except (RuntimeError, OSError) as exc:  # a failed build, a read-only cache
            reason = str(exc)
    log.warning("fused CPU kernels unavailable (%s); eager torch ops", reason)
    return None


def row_threads(rows: int) -> int:
    """The OpenMP threads a call over ``rows`` rows splits them over: one per
    :data:`ROWS_PER_THREAD` rows, at most torch's intra-op threads, at least 1 (the
    calling thread alone)."""
    return max(1, min(torch.get_num_threads(), rows // ROWS_PER_THREAD))


def _check_done(bad: int) -> None:
    if bad:
        raise RuntimeError("a fused native kernel refused its arguments")


def _check_rows(name: str, t: torch.Tensor, dtype: torch.dtype, width: int) -> None:
    if t.dim() != 2 or t.dtype != dtype or t.device.type != "cpu" or t.shape[1] != width:
        raise ValueError(f"{name}: need [rows, {width}] {dtype} on the CPU, got "
                         f"{tuple(t.shape)} {t.dtype} on {t.device}")  # fmt: skip
    if t.stride(1) != 1:
        raise ValueError(f"{name}: rows must be contiguous (strides {t.stride()})")


def add_rmsnorm(
    kernels: FusedKernels,
    x: torch.Tensor | None,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
) -> None:
    """``residual += x`` (in place; skipped if ``x`` is None), then ``out =
    RMSNorm(residual)`` with ``weight``: the eager ``h = h + x; out = norm(h)``.
    All [rows, hidden] (``weight`` [hidden]) of one dtype."""
    dtype, (rows, width) = residual.dtype, residual.shape
    if dtype not in DTYPES or width < 8:
        raise ValueError(f"add_rmsnorm: dtype {dtype}, width {width} (at least 8)")
    _check_rows("residual", residual, dtype, width)
    _check_rows("out", out, dtype, width)
    if x is not None:
        _check_rows("x", x, dtype, width)
    if weight.shape != (width,) or weight.dtype != dtype or not weight.is_contiguous():
        raise ValueError(f"weight: need [{width}] contiguous {dtype}, got "
                         f"{tuple(weight.shape)} {weight.dtype}")  # fmt: skip
    if out.shape[0] != rows or (x is not None and x.shape[0] != rows):
        raise ValueError("add_rmsnorm: x, residual and out need the same rows")
    xp, xs = (x.data_ptr(), x.stride(0)) if x is not None else (None, 0)
    fn = kernels.add_rmsnorm[dtype]
    _check_done(fn(xp, xs, residual.data_ptr(), residual.stride(0), weight.data_ptr(),
                   out.data_ptr(), out.stride(0), rows, width, eps, row_threads(rows)))  # fmt: skip


@dataclass(frozen=True)
class RopeRows:
    """A step's positions and KV slots, checked once (:func:`plan_rope`) for all layers."""

    positions: torch.Tensor  # [T] int64, contiguous
    slots: torch.Tensor  # [T] int64, contiguous
    max_position: int  # -1 for no rows
    max_slot: int


def plan_rope(positions: torch.Tensor, slot_mapping: torch.Tensor) -> RopeRows:
    """Check a step's ``positions`` and ``slot_mapping`` ([T] int64, non-negative)."""
    rows = positions.shape[0]
    for name, idx in (("positions", positions), ("slot_mapping", slot_mapping)):
        if idx.shape != (rows,) or idx.dtype != torch.int64 or not idx.is_contiguous():
            raise ValueError(f"{name}: need [{rows}] contiguous int64, got "
                             f"{tuple(idx.shape)} {idx.dtype}")  # fmt: skip
        if rows and int(idx.min()) < 0:
            raise ValueError(f"{name}: negative values")
    if not rows:
        return RopeRows(positions, slot_mapping, -1, -1)
    return RopeRows(positions, slot_mapping, int(positions.max()), int(slot_mapping.max()))


def rope_write_kv(
    kernels: FusedKernels,
    qkv: torch.Tensor,
    num_heads: int,
    rows_plan: RopeRows,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> None:
    """Rotate the q heads of ``qkv`` [T, (H + 2 Hkv) * D] in place, and write each row's
    rotated k and its v into the caches [blocks, block_size, Hkv, D] at its slot (int8
    caches: quantized rows of D + 4 bytes, :mod:`engine.kernels.kv_int8`);
    ``cos``/``sin``: the [max_positions, D] tables (:class:`engine.model.rope.RotaryEmbedding`)."""
    dtype, rows = qkv.dtype, qkv.shape[0]
    int8 = k_cache.dtype == torch.int8
    num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
    head_dim = head_dim_of(k_cache)
    if dtype not in DTYPES or head_dim % 2 or (int8 and head_dim > MAX_INT8_HEAD_DIM):
        raise ValueError(f"rope_write_kv: {dtype}, head_dim {head_dim}")
    _check_rows("qkv", qkv, dtype, (num_heads + 2 * num_kv_heads) * head_dim)
    cache_dtype = torch.int8 if int8 else dtype
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.shape != k_cache.shape or t.dtype != cache_dtype or not t.is_contiguous():
            raise ValueError(f"{name}: need contiguous {tuple(k_cache.shape)} {cache_dtype}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 2 or t.shape[1] != head_dim or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"{name}: need contiguous [positions, {head_dim}] {dtype}")
    if rows_plan.positions.shape[0] != rows:
        raise ValueError(f"rope_write_kv: {rows} rows, a plan for {rows_plan.positions.shape[0]}")
    if rows_plan.max_position >= cos.shape[0] or rows_plan.max_slot >= num_blocks * block_size:
        raise ValueError("rope_write_kv: a position past the tables or a slot past the cache")
    fn = (kernels.rope_kv_int8 if int8 else kernels.rope_kv)[dtype]
    _check_done(fn(qkv.data_ptr(), qkv.stride(0), rows, num_heads, num_kv_heads, head_dim,
                   rows_plan.positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                   rows_plan.slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                   row_threads(rows)))  # fmt: skip


def silu_mul(kernels: FusedKernels, gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` [T, 2 I] (gate the first I columns): [T, I]."""
    dtype, rows = gate_up.dtype, gate_up.shape[0]
    width = gate_up.shape[1] // 2
    if dtype not in DTYPES:
        raise ValueError(f"silu_mul: dtype {dtype}")
    _check_rows("gate_up", gate_up, dtype, 2 * width)
    out = torch.empty((rows, width), dtype=dtype)
    _check_done(kernels.silu_mul[dtype](gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(),
                                        width, rows, width, row_threads(rows)))  # fmt: skip
    return out


def argmax_rows(kernels: FusedKernels, logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest value of ``logits`` [rows, V] float32 on the CPU
    (rows contiguous): the first of equal ones, the first NaN where a row has one, as
    ``logits.max(dim=-1).indices``; int64 [rows]. 64 x 49,152 (a decode step's LM head),
    2 threads of an AMX Xeon: 0.31 ms against torch's 0.84 (reading the logits)."""
    _check_rows("logits", logits, torch.float32, logits.shape[-1] if logits.dim() == 2 else 0)
    rows, width = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    if rows:
        _check_done(kernels.argmax(logits.data_ptr(), logits.stride(0), rows, width,
                                   out.data_ptr(), row_threads(rows)))  # fmt: skip
    return out
