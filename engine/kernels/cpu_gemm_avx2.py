"""Int8 linear layers for CPUs with AVX2 but without the AVX-512 int8 kernel of
:mod:`engine.kernels.cpu_gemm` (``native/cpu_gemm_avx2.cpp``; the opt-in quantized path,
``linear_quant="int8"``).

Weights per output channel int8 (as :class:`engine.kernels.cpu_gemm.NativeInt8Gemm`'s);
each float32 input row rounded to int16 with its own scale inside the call; products
summed exactly in int32 by ``vpmaddwd``; float32 out. A row's result does not depend on
the rows beside it or on the thread count.

Why: there the quantized path ran on torch's fbgemm, whose inputs are 7-bit without VNNI
(:mod:`engine.model.int8_linear`); on an AVX2-only EPYC its greedy answers matched the
float32 model's in 3 of 64 bench prompts. int16 inputs keep ~1 part in 10^4 of a row's
largest value, so only the weights' rounding is coarse, and ``vpmaddwd`` does 16
multiply-adds an instruction against FMA's 8 while the weights stream a quarter of the
float32 bytes. Measured on an AVX2-only EPYC (AMD family 25 model 1, 2 threads) by
``bench/cpu_gemm.py --avx2``, against torch's oneDNN-packed float32 linear (the engine's
float32 path) in the same run, SmolLM2-135M's projections (30 layers' weights in turn):
3.4-4.0x at 1 row, 2.2-2.9x at 16, 1.6-2.2x at 64 and 1.3-1.6x at 512 rows (that bench's
docstring has the table). On the 64-request bench (``bench/engine_quant.py --dtype
float32``), greedy answers identical to the float32 model's: 30 of 64 (fbgemm's: 3);
perplexity on the held-in text 41.04 -> 40.81 (fbgemm's: +25%).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from engine.kernels import native_build
from engine.kernels.cpu_gemm import aligned_empty, kernel_here, quantize_per_channel

SOURCE = native_build.SOURCE.with_name("cpu_gemm_avx2.cpp")
FLAGS = ("-fopenmp",)


@dataclass(frozen=True)
class Avx2Int8Weight:
    """A weight [n, k] quantized per output channel (``scale = max |w| / 127`` of its
    row) and packed for :meth:`Avx2Int8Gemm.linear`."""

    packed: torch.Tensor  # int8 [n * k], 64-byte aligned: the panels
    col_scale: torch.Tensor  # float32 [n]
    out_features: int
    in_features: int
    paired: bool = False  # a gate and an up projection stacked: silu_mul can run fused


@dataclass(frozen=True)
class Avx2Int8Gemm:
    """The loaded library's entry points."""

    path: Path
    _pack: Callable[..., int]
    _gemm: Callable[..., int]
    _qmax: Callable[[int], int]
    input_dtype: ClassVar[torch.dtype] = torch.float32  # what :meth:`linear` takes and gives

    @staticmethod
    def supports(weight: torch.Tensor, paired: bool = False) -> bool:
        """Whether ``weight`` [n, k] can be quantized and packed: a floating CPU tensor,
        n and k multiples of 16 (``paired``, gate rows then up rows: the same)."""
        return (
            weight.dtype.is_floating_point
            and weight.device.type == "cpu"
            and weight.dim() == 2
            and weight.shape[0] % 16 == 0
            and weight.shape[1] % 16 == 0
        )

    def qmax(self, k: int) -> int:
        """The largest int16 magnitude a row of ``k`` inputs is rounded to (so that no
        int32 sum of k products with int8 weights overflows)."""
        return int(self._qmax(k))

    def quantize(self, weight: torch.Tensor, paired: bool = False) -> Avx2Int8Weight:
        """``weight`` [n, k] (:meth:`supports`) as per-channel int8, packed; ``paired``:
        a gate and an up projection stacked (gate rows first), packed so that
        :meth:`silu_mul` can run (:meth:`linear`'s products are the same)."""
        if not self.supports(weight):
            raise ValueError(f"cannot quantize a {weight.dtype} {tuple(weight.shape)} weight on "
                             f"{weight.device}: floating [n, k] on the CPU, n and k multiples "
                             "of 16")  # fmt: skip
        n, k = weight.shape
        q, scale = quantize_per_channel(weight)
        packed = aligned_empty(n * k, torch.int8)
        if self._pack(q.data_ptr(), n, k, int(paired), packed.data_ptr()):
            raise ValueError(f"the library refused to pack a {tuple(weight.shape)} weight")
        return Avx2Int8Weight(packed, scale, n, k, paired)

    def linear(self, x: torch.Tensor, weight: Avx2Int8Weight, threads: int) -> torch.Tensor:
        """``x`` [rows, k] float32 (rows contiguous in k) times the weight's transpose:
        [rows, out_features] float32."""
        return self._call(x, weight, threads, silu=False)

    def silu_mul(self, x: torch.Tensor, weight: Avx2Int8Weight, threads: int) -> torch.Tensor:
        """SiLU(gate) * up of the product of ``x`` with a paired weight (gate, then up):
        [rows, out_features / 2] float32, close to ``F.silu(gate) * up`` of
        :meth:`linear`'s output (the kernel's exp is within ~2 ulp of torch's)."""
        if not weight.paired:
            raise ValueError("silu_mul needs a weight quantized with paired=True")
        return self._call(x, weight, threads, silu=True)

    def _call(
        self, x: torch.Tensor, weight: Avx2Int8Weight, threads: int, silu: bool
    ) -> torch.Tensor:
        if x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1:
            raise ValueError(f"x must be float32 [rows, k] with unit column stride, got "
                             f"{x.dtype} {tuple(x.shape)} strides {x.stride()}")  # fmt: skip
        rows, k = x.shape
        if k != weight.in_features:
            raise ValueError(f"x has {k} features, the weight {weight.in_features}")
        n = weight.out_features
        width = n // 2 if silu else n
        out = torch.empty((rows, width), dtype=torch.float32)
        if rows:
            scratch = torch.empty(rows * k, dtype=torch.int16)
            row_scale = torch.empty(rows, dtype=torch.float32)
            if self._gemm(x.data_ptr(), x.stride(0), rows, weight.packed.data_ptr(),
                          weight.col_scale.data_ptr(), n, k, int(weight.paired), int(silu),
                          out.data_ptr(), width, scratch.data_ptr(), row_scale.data_ptr(),
                          max(1, threads)):  # fmt: skip
                raise ValueError(f"the library refused a [{rows}, {k}] x [{n}, {k}] int8 product")
        return out


@functools.cache
def load_avx2_int8_gemm(cache_dir: Path) -> Avx2Int8Gemm:
    """Build (first use on a machine, a few seconds) and load the library from
    ``cache_dir``, memoised per process; RuntimeError or OSError where it cannot be built
    or loaded here (no AVX2/FMA, no compiler)."""
    path = native_build.build(cache_dir, SOURCE, FLAGS, required=native_build.AVX2_CPU_FLAGS)
    lib = ctypes.CDLL(str(path))  # after torch (imported above): its libgomp is the one used
    if not lib.kvt_gemm_avx2_available():
        raise RuntimeError("the library was built without AVX2")
    i32, i64, ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
    pack = lib.kvt_gemm_avx2_pack
    pack.argtypes, pack.restype = [ptr, i32, i32, i32, ptr], i32  # w, n, k, paired, packed
    gemm = lib.kvt_gemm_avx2
    # x, its row stride, rows, packed, col_scale, n, k, paired, silu, out, its row stride,
    # scratch, row_scale, threads
    gemm.argtypes = [ptr, i64, i32, ptr, ptr, i32, i32, i32, i32, ptr, i64, ptr, ptr, i32]
    gemm.restype = i32
    qmax = lib.kvt_gemm_avx2_qmax
    qmax.argtypes, qmax.restype = [i32], i32
    return Avx2Int8Gemm(path, pack, gemm, qmax)


def avx2_int8_gemm_here(cache_dir: Path | None = None) -> Avx2Int8Gemm | None:
    """The kernel if it builds and loads here (AVX2 and FMA, a compiler), else None (why:
    logged at info; int8 linears then run on torch's fbgemm)."""
    return kernel_here(load_avx2_int8_gemm, cache_dir, "AVX2 int8 linears unavailable, fbgemm's",
                       required=native_build.AVX2_CPU_FLAGS)  # fmt: skip
