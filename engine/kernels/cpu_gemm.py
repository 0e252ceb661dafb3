"""Linear layers on the CPU's AVX-512 dot products (``native/cpu_gemm.cpp``): bfloat16
(AVX512-BF16, :class:`NativeGemm`) and int8 (AVX512-VNNI, :class:`NativeInt8Gemm`, the
opt-in quantized path).

:func:`gemm_here` / :func:`int8_gemm_here` build (first use on a machine, a few seconds)
and load the library, or say why not; ``pack`` / ``quantize`` lay a weight out once,
``linear`` multiplies rows against it on the OpenMP threads torch runs (the library's
libgomp is torch's). A weight packed ``paired`` (a gate and an up projection stacked)
also gives ``silu_mul``: SiLU(gate) * up straight from the kernel's epilogue.

bfloat16: products exact, summed in float32, the sums rounded to bfloat16 as oneDNN rounds
them; the order of the sums differs from oneDNN's, so an output may differ from torch's in
its last bfloat16 bit. int8: weights per output channel, each input row quantized with its
own scale inside the call, exact int32 sums; ~1.1% relative error of a product.

Measured on a Zen 4 EPYC (2 threads, AVX512-BF16/VNNI, no AMX) by ``bench/cpu_gemm.py``:
SmolLM2-135M's projections, 30 layers' weights in turn (the LM head one), interleaved
best of 11, against torch's oneDNN-packed bfloat16 linear in the same run, us per call::

    k x n (layer)          rows 1          16             64              512
    576 x 960 (q/k/v)      30 vs 69       61 vs 102     186 vs 248     1,273 vs 1,394
    576 x 576 (o)          14 vs 41       33 vs 64      112 vs 146       778 vs 838
    576 x 3,072 (gate/up) 118 vs 189     173 vs 239     562 vs 634     4,078 vs 4,310
    1,536 x 576 (down)     50 vs 95       82 vs 128     278 vs 342     2,002 vs 2,100
    576 x 49,152 (head) 1,369 vs 2,015 2,507 vs 3,060 8,767 vs 9,358 65,828 vs 78,427

1.2-1.9x at 16 rows, 1.07-1.33x at 64, 1.05-1.19x at 512; of the outputs, ~1 in 10,000
differs from oneDNN's in its last bit. The int8 kernel runs the same 512-bit dot products
a cycle with twice the multiply-adds each: 620-830 GOP/s at 64-512 rows against the
bfloat16 kernel's 410-450 GFLOP/s. Whether the bfloat16 kernel wins on another CPU is
raced at start-up: :mod:`engine.model.native_linear`.

Where the CPU has AMX-BF16 and Linux grants the process the tile state, the bfloat16
kernel multiplies on the tiles (:attr:`NativeGemm.amx`; the same packed panels feed them;
:meth:`NativeGemm.on_vectors` keeps the AVX-512 path). On a 2-core Xeon with AMX its
AVX-512 path ran ~200 GFLOP/s, far behind oneDNN's AMX matmul; on the tiles, same run,
us per call against oneDNN (``bench/cpu_gemm.py``)::

    k x n (layer)          rows 1        16          64           128         512
    576 x 960 (q/k/v)      56 vs 98     56 vs 93    99 vs 128    171 vs 202    498 vs 441
    576 x 576 (o)          29 vs 68     26 vs 63    56 vs 88      91 vs 119    305 vs 486
    576 x 3,072 (gate/up) 160 vs 235   168 vs 255  281 vs 367    472 vs 512  1,563 vs 1,612
    1,536 x 576 (down)     78 vs 110    79 vs 116  124 vs 165    194 vs 227    634 vs 946
    576 x 49,152 (head) 2,133 vs 2,654 2,233 vs 2,731 4,108 vs 3,789 6,607 vs 5,877 34,831 vs 34,102

The tiles' sums differ from the AVX-512 path's in the last bit of ~1 output in 10,000;
rows stay batch-invariant. The int8 kernel runs on the tiles likewise (tdpbusd, where the
CPU has AMX-INT8), with exact int32 sums: the same outputs as its VNNI path bit for bit,
same machine, us per call at 16 / 64 / 512 rows: q/k/v 33 / 62 / 281 (VNNI 62 / 115 /
568), gate/up 105 / 167 / 840 (170 / 327 / 1,737), LM head 1,081 / 1,660 / 22,350 (2,025 /
4,271 / 36,546).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, TypeVar

import torch

from engine.kernels import native_build

log = logging.getLogger(__name__)
SOURCE = native_build.SOURCE.with_name("cpu_gemm.cpp")
_Kernel = TypeVar("_Kernel")


def _check_rows(x: torch.Tensor) -> None:
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be bfloat16 [rows, k] with unit column stride, got "
                         f"{x.dtype} {tuple(x.shape)} strides {x.stride()}")  # fmt: skip


def aligned_empty(size: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """An uninitialised 1-D tensor of ``size`` elements whose data starts on 64 bytes."""
    item = torch.empty(0, dtype=dtype).element_size()
    raw = torch.empty(size + 64 // item, dtype=dtype)  # room to align to 64 bytes
    shift = (-raw.data_ptr() % 64) // item
    return raw[shift : shift + size]


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [n, k] as int8 per output channel, symmetric: (q int8 [n, k] contiguous,
    scale float32 [n] with ``scale = max |w| / 127`` of each row), the native int8
    kernels' weights (this module's and :mod:`engine.kernels.cpu_gemm_avx2`'s)."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
    return q, scale.contiguous()


def _shape_ok(weight: torch.Tensor, k_multiple: int, paired: bool) -> bool:
    """[n, k] on the CPU, n a multiple of 16, k of ``k_multiple``; ``paired``: n a
    multiple of 128 (halves of whole 16-column vectors, and SiLU's width a multiple of 64,
    where torch's SiLU runs its vector code throughout: cpu_fused.cpp's silu_mul)."""
    return (
        weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.shape[0] % (128 if paired else 16) == 0
        and weight.shape[1] % k_multiple == 0
    )


@dataclass(frozen=True)
class NativeGemm:
    """The loaded library's bfloat16 entry points.

    ``paired`` packs a gate and up projection stacked as [2I, k] so that a call can also
    return SiLU(gate) * up [rows, I] directly (:meth:`silu_mul`); its plain products are
    the same as unpaired ones."""

    path: Path
    _packed_size: Callable[..., int]
    _pack: Callable[..., int]
    _gemm: Callable[..., int]
    amx: bool = False  # multiplies on the AMX tiles (load_gemm: where the process has them)

    @staticmethod
    def supports(weight: torch.Tensor, paired: bool = False) -> bool:
        """Whether ``weight`` [n, k] can be packed: bfloat16 on the CPU, n a multiple of
        16 (128 paired), k even (on the AMX tiles where k is a multiple of 32, else on
        the vectors)."""
        return weight.dtype == torch.bfloat16 and _shape_ok(weight, 2, paired)

    def on_vectors(self) -> NativeGemm:
        """The same library on its AVX-512 dot products, not the AMX tiles (packed weights
        are the same for both)."""
        return dataclasses.replace(self, amx=False)

    def pack(self, weight: torch.Tensor, paired: bool = False) -> torch.Tensor:
        """The packed copy of ``weight`` [n, k] (:meth:`supports`), 64-byte aligned."""
        if not self.supports(weight, paired):
            raise ValueError(f"cannot pack a {weight.dtype} {tuple(weight.shape)} weight on "
                             f"{weight.device}: bfloat16 [n, k] on the CPU, n % "
                             f"{128 if paired else 16} == 0, k even")  # fmt: skip
        n, k = weight.shape
        w = weight.detach().contiguous()
        packed = aligned_empty(int(self._packed_size(n, k)))
        if self._pack(w.data_ptr(), n, k, int(paired), packed.data_ptr()):
            raise ValueError(f"the library refused to pack a {tuple(weight.shape)} weight")
        return packed

    def linear(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        out_features: int,
        threads: int,
        paired: bool = False,
    ) -> torch.Tensor:
        """``x`` [rows, k] bfloat16 (rows contiguous in k) times the packed weight's
        transpose: [rows, out_features] bfloat16."""
        return self._call(x, packed, out_features, threads, paired, silu=False)

    def silu_mul(
        self, x: torch.Tensor, packed: torch.Tensor, out_features: int, threads: int
    ) -> torch.Tensor:
        """SiLU(gate) * up of the product of ``x`` with a paired weight of
        ``out_features`` rows (gate, then up): [rows, out_features / 2] bfloat16, what
        :func:`engine.kernels.cpu_fused.silu_mul` gives from :meth:`linear`'s output."""
        return self._call(x, packed, out_features, threads, paired=True, silu=True)

    def _call(self, x: torch.Tensor, packed: torch.Tensor, n: int, threads: int, paired: bool,
              silu: bool) -> torch.Tensor:  # fmt: skip
        _check_rows(x)
        rows, k = x.shape
        if packed.numel() != n * (k // 2):
            raise ValueError(f"the packed weight holds {packed.numel()} pairs, not "
                             f"{n} x {k // 2}")  # fmt: skip
        width = n // 2 if silu else n
        out = torch.empty((rows, width), dtype=torch.bfloat16)
        if rows and self._gemm(x.data_ptr(), x.stride(0), rows, packed.data_ptr(), n, k,
                               int(paired), int(silu), out.data_ptr(), width,
                               threads, int(self.amx)):  # fmt: skip
            raise ValueError(f"the library refused a [{rows}, {k}] x [{n}, {k}] product"
                             + (" (paired)" if paired else ""))  # fmt: skip
        return out


@dataclass(frozen=True)
class Int8Weight:
    """A weight [n, k] quantized per output channel (symmetric: ``scale = max |w| / 127``
    of its row) and packed for :meth:`NativeInt8Gemm.linear`; ``paired`` as
    :class:`NativeGemm`'s."""

    packed: torch.Tensor  # int32, the panels
    col_scale: torch.Tensor  # float32 [n]
    comp: torch.Tensor  # int32 [n]: 128 x each column's int8 weight sum
    out_features: int
    in_features: int
    paired: bool = False


@dataclass(frozen=True)
class NativeInt8Gemm:
    """The loaded library's int8 entry points (AVX512-VNNI ``vpdpbusd``): inputs quantized
    per row inside each call, int32 sums, outputs dequantized and rounded to bfloat16."""

    path: Path
    _pack: Callable[..., int]
    _gemm: Callable[..., int]
    amx: bool = False  # multiplies on the AMX tiles (load_int8_gemm: where it may)
    input_dtype: ClassVar[torch.dtype] = torch.bfloat16  # what linear takes and gives

    def on_vectors(self) -> NativeInt8Gemm:
        """The same library on its AVX512-VNNI dot products, not the AMX tiles (the same
        outputs, bit for bit)."""
        return dataclasses.replace(self, amx=False)

    @staticmethod
    def supports(weight: torch.Tensor, paired: bool = False) -> bool:
        """Whether ``weight`` [n, k] can be quantized and packed: a floating CPU tensor,
        n a multiple of 16 (128 paired), k of 16 (on the AMX tiles where k is a multiple
        of 64, else on the vectors)."""
        return weight.dtype.is_floating_point and _shape_ok(weight, 16, paired)

    def quantize(self, weight: torch.Tensor, paired: bool = False) -> Int8Weight:
        """``weight`` [n, k] (:meth:`supports`) as per-channel int8, packed."""
        if not self.supports(weight, paired):
            raise ValueError(f"cannot quantize a {weight.dtype} {tuple(weight.shape)} weight on "
                             f"{weight.device}: floating [n, k] on the CPU, n a multiple of "
                             f"{128 if paired else 16}, k of 16")  # fmt: skip
        n, k = weight.shape
        q, scale = quantize_per_channel(weight)
        packed = aligned_empty(n * k // 4)
        comp = torch.empty(n, dtype=torch.int32)
        if self._pack(q.data_ptr(), n, k, int(paired), packed.data_ptr(), comp.data_ptr()):
            raise ValueError(f"the library refused to pack a {tuple(weight.shape)} weight")
        return Int8Weight(packed, scale, comp, n, k, paired)

    def linear(self, x: torch.Tensor, weight: Int8Weight, threads: int) -> torch.Tensor:
        """``x`` [rows, k] bfloat16 (rows contiguous in k) times the weight's transpose:
        [rows, out_features] bfloat16."""
        return self._call(x, weight, threads, silu=False)

    def silu_mul(self, x: torch.Tensor, weight: Int8Weight, threads: int) -> torch.Tensor:
        """SiLU(gate) * up of the product of ``x`` with a paired weight (gate, then up):
        [rows, out_features / 2] bfloat16, what :func:`engine.kernels.cpu_fused.silu_mul`
        gives from :meth:`linear`'s output."""
        if not weight.paired:
            raise ValueError("silu_mul needs a weight quantized with paired=True")
        return self._call(x, weight, threads, silu=True)

    def _call(self, x: torch.Tensor, weight: Int8Weight, threads: int, silu: bool) -> torch.Tensor:
        _check_rows(x)
        rows, k = x.shape
        if k != weight.in_features:
            raise ValueError(f"x has {k} features, the weight {weight.in_features}")
        n = weight.out_features
        width = n // 2 if silu else n
        out = torch.empty((rows, width), dtype=torch.bfloat16)
        if rows:
            scratch = torch.empty(rows * k, dtype=torch.uint8)
            row_scale = torch.empty(rows, dtype=torch.float32)
            if self._gemm(x.data_ptr(), x.stride(0), rows, weight.packed.data_ptr(),
                          weight.col_scale.data_ptr(), weight.comp.data_ptr(), n, k,
                          int(weight.paired), int(silu), out.data_ptr(), width,
                          scratch.data_ptr(), row_scale.data_ptr(), threads,
                          int(self.amx)):  # fmt: skip
                raise ValueError(f"the library refused a [{rows}, {k}] x [{n}, {k}] int8 product")
        return out


@functools.cache
def _library(cache_dir: Path) -> tuple[Path, ctypes.CDLL]:
    """The library, built on first use on a machine and loaded once per process (both
    kernels' entry points live in it). RuntimeError or OSError where it cannot be built or
    loaded here."""
    path = native_build.build(cache_dir, SOURCE, native_build.GEMM_FLAGS)
    return path, ctypes.CDLL(str(path))


@functools.cache
def load_gemm(cache_dir: Path) -> NativeGemm:
    """The bfloat16 kernel's entry points, on the AMX tiles where the build and the CPU
    have AMX-BF16 and the kernel grants them; memoised per process. RuntimeError or
    OSError where the library cannot be built or loaded here; RuntimeError where it was
    built without the kernel (no AVX512-BF16)."""
    path, lib = _library(cache_dir)
    if not lib.kvt_gemm_available():
        raise RuntimeError("the CPU lacks AVX512-BF16 (no bfloat16 dot products)")
    i32, i64, ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
    size = lib.kvt_gemm_packed_size
    size.argtypes, size.restype = [i32, i32], i64
    pack = lib.kvt_gemm_pack
    pack.argtypes, pack.restype = [ptr, i32, i32, i32, ptr], i32  # w, n, k, paired, packed
    gemm = lib.kvt_gemm
    # x, its row stride, rows, packed, n, k, paired, silu, out, its row stride, threads, amx
    gemm.argtypes = [ptr, i64, i32, ptr, i32, i32, i32, i32, ptr, i64, i32, i32]
    gemm.restype = i32
    amx = bool(lib.kvt_gemm_amx_available())  # asks the kernel for the tiles once
    return NativeGemm(path, size, pack, gemm, amx)


@functools.cache
def load_int8_gemm(cache_dir: Path) -> NativeInt8Gemm:
    """The int8 kernel's entry points, on the AMX tiles where the build and the CPU have
    AMX-INT8 and the kernel grants them; memoised per process. RuntimeError or OSError
    where the library cannot be built or loaded here, or was built without the int8
    kernel (no AVX512-VNNI or -BF16)."""
    path, lib = _library(cache_dir)
    if not lib.kvt_gemm_i8_available():
        raise RuntimeError("the CPU lacks AVX512-VNNI or AVX512-BF16")
    i32, i64, ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
    pack = lib.kvt_gemm_i8_pack
    pack.argtypes, pack.restype = [ptr, i32, i32, i32, ptr, ptr], i32  # w, n, k, paired, ..
    gemm = lib.kvt_gemm_i8
    # x, its row stride, rows, packed, col_scale, comp, n, k, paired, silu, out, its row
    # stride, scratch, row_scale, threads, amx
    gemm.argtypes = [ptr, i64, i32, ptr, ptr, ptr, i32, i32, i32, i32, ptr, i64, ptr, ptr, i32, i32]
    gemm.restype = i32
    return NativeInt8Gemm(path, pack, gemm, bool(lib.kvt_gemm_i8_amx_available()))


def kernel_here(
    load: Callable[[Path], _Kernel],
    cache_dir: Path | None,
    what: str,
    required: frozenset[str] = native_build.REQUIRED_CPU_FLAGS,
) -> _Kernel | None:
    """``load`` 's kernel if it builds and loads here (``required``: the CPU flags its
    source needs), else None (why: logged at info, with ``what`` runs instead)."""
    reason = native_build.unavailable_reason(required=required)
    if reason is None:
        try:
            return load(cache_dir or native_build.default_cache_dir())
        except (RuntimeError, OSError) as exc:
            reason = str(exc)
    log.info("%s (%s)", what, reason)
    return None


def gemm_here(cache_dir: Path | None = None) -> NativeGemm | None:
    """The bfloat16 kernel if it builds, loads and has AVX512-BF16 here, else None
    (bfloat16 linears then stay on oneDNN)."""
    return kernel_here(load_gemm, cache_dir, "native bfloat16 linears unavailable, oneDNN's")


def int8_gemm_here(cache_dir: Path | None = None) -> NativeInt8Gemm | None:
    """The int8 kernel if it builds, loads and has AVX512-VNNI and -BF16 here, else None
    (int8 linears then run on :mod:`engine.kernels.cpu_gemm_avx2`'s kernel or torch's
    fbgemm)."""
    return kernel_here(load_int8_gemm, cache_dir, "AVX-512 int8 linears unavailable")
