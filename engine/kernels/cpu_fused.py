"""The Llama decoder's small per-layer ops fused in native AVX-512 code (CPU, float32 and
bfloat16): residual add + RMSNorm, RoPE + the K/V write into the paged cache, and
SiLU(gate) * up, each one pass over its rows (``native/cpu_fused.cpp``, built by
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
Rows are split over :data:`ROW_SPLIT` Python threads when there are many (ctypes
releases the GIL while a kernel runs). The reference for each is the eager torch code
it replaces (tests/engine/kernels/test_cpu_fused.py).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.kernels import native_build
from engine.kernels.kv_int8 import head_dim_of

log = logging.getLogger(__name__)
DTYPES = (torch.float32, torch.bfloat16)
MAX_INT8_HEAD_DIM = 256  # cpu_fused.cpp's MAX_HEAD_DIM (its per-head scratch)
# Rows from which a call is split in halves run on two threads at once: below this the
# hand-off (~20 us) costs more than the second core saves.
PARALLEL_ROWS = 96
ROW_SPLIT = 2


@dataclass(frozen=True)
class FusedKernels:
    """The loaded library's entry points by dtype, and a pool that runs row halves."""

    path: Path
    add_rmsnorm: dict[torch.dtype, Any]
    rope_kv: dict[torch.dtype, Any]
    rope_kv_int8: dict[torch.dtype, Any]  # by the activations' dtype; int8 caches
    silu_mul: dict[torch.dtype, Any]
    pool: ThreadPoolExecutor


def _entries(lib: ctypes.CDLL, name: str, argtypes: list[Any]) -> dict[torch.dtype, Any]:
    out = {}
    for dtype, suffix in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
        fn = getattr(lib, f"kvt_{name}_{suffix}")
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int32
        out[dtype] = fn
    return out


@functools.cache
def load_fused_kernels(cache_dir: Path) -> FusedKernels:
    """Build (first time on a machine, a few seconds) or load the library; memoised per
    process. RuntimeError or OSError where it cannot be built or loaded here."""
    path = native_build.build(cache_dir, native_build.FUSED_SOURCE, native_build.FUSED_FLAGS)
    lib = ctypes.CDLL(str(path))
    i32, i64, f32, ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    return FusedKernels(
        path,
        # x, x stride, residual, its stride, weight, out, its stride, rows, width, eps
        _entries(lib, "add_rmsnorm", [ptr, i64, ptr, i64, ptr, ptr, i64, i32, i32, f32]),
        # qkv, row stride, rows, heads, kv heads, head_dim, positions, cos, sin, slots, k, v
        _entries(lib, "rope_kv", [ptr, i64, i32, i32, i32, i32, ptr, ptr, ptr, ptr, ptr, ptr]),
        _entries(lib, "rope_kv_int8",
                 [ptr, i64, i32, i32, i32, i32, ptr, ptr, ptr, ptr, ptr, ptr]),
        # gate_up, its stride, out, its stride, rows, width
        _entries(lib, "silu_mul", [ptr, i64, ptr, i64, i32, i32]),
        ThreadPoolExecutor(max_workers=ROW_SPLIT - 1, thread_name_prefix="kvtoll-fused"),
    )


def fused_kernels_here(cache_dir: Path | None = None) -> FusedKernels | None:
    """The kernels if they build and load here (``cache_dir``: default
    :func:`engine.kernels.native_build.default_cache_dir`), else None, with the reason
    logged: the model then runs its eager torch ops."""
    reason = native_build.unavailable_reason()
    if reason is None:
        try:
            return load_fused_kernels(cache_dir or native_build.default_cache_dir())
        except (RuntimeError, OSError) as exc:  # a failed build, a read-only cache
            reason = str(exc)
    log.warning("fused CPU kernels unavailable (%s); eager torch ops", reason)
    return None


def _run_rows(kernels: FusedKernels, rows: int, call: Any) -> None:
    """``call(first, count)`` over ``rows`` rows: in halves on two threads when many."""
    if rows < PARALLEL_ROWS:
        bad = call(0, rows)
    else:
        half = rows // 2
        other = kernels.pool.submit(call, half, rows - half)
        bad = call(0, half) | other.result()
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
    fn, size = kernels.add_rmsnorm[dtype], residual.element_size()
    xp, xs = (x.data_ptr(), x.stride(0)) if x is not None else (None, 0)
    rp, rs, op, os_ = residual.data_ptr(), residual.stride(0), out.data_ptr(), out.stride(0)
    wp = weight.data_ptr()
    _run_rows(kernels, rows, lambda a, n: fn(
        None if xp is None else xp + a * xs * size, xs, rp + a * rs * size, rs, wp,
        op + a * os_ * size, os_, n, width, eps))  # fmt: skip


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
    fn, size = (kernels.rope_kv_int8 if int8 else kernels.rope_kv)[dtype], qkv.element_size()
    qp, qs = qkv.data_ptr(), qkv.stride(0)
    pp, sp = rows_plan.positions.data_ptr(), rows_plan.slots.data_ptr()
    cp, snp, kp, vp = cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr()
    _run_rows(kernels, rows, lambda a, n: fn(
        qp + a * qs * size, qs, n, num_heads, num_kv_heads, head_dim, pp + 8 * a, cp, snp,
        sp + 8 * a, kp, vp))  # fmt: skip


def silu_mul(kernels: FusedKernels, gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` [T, 2 I] (gate the first I columns): [T, I]."""
    dtype, rows = gate_up.dtype, gate_up.shape[0]
    width = gate_up.shape[1] // 2
    if dtype not in DTYPES:
        raise ValueError(f"silu_mul: dtype {dtype}")
    _check_rows("gate_up", gate_up, dtype, 2 * width)
    out = torch.empty((rows, width), dtype=dtype)
    fn, size = kernels.silu_mul[dtype], gate_up.element_size()
    gp, gs, op = gate_up.data_ptr(), gate_up.stride(0), out.data_ptr()
    _run_rows(kernels, rows, lambda a, n: fn(gp + a * gs * size, gs, op + a * width * size,
                                             width, n, width))  # fmt: skip
    return out
