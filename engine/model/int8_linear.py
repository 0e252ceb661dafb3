"""Int8 linear layers for the CPU (the opt-in quantized path, ``linear_quant="int8"``).

Weights are quantized once, per output channel and symmetric (``scale = max |w| / 127``
of each row). Three ways to multiply:

* :class:`NativeInt8Linear` (where :mod:`engine.kernels.cpu_gemm`'s int8 kernel builds:
  AVX512-VNNI and -BF16): each call quantizes every input row with its own scale
  (symmetric, ``max |x| / 127``) inside the kernel, sums int8 products in int32 with
  ``vpdpbusd`` (on AMX tiles, ``tdpbusd``, where the CPU has AMX-INT8: the same sums)
  and rounds the dequantized sums to bfloat16. A row's result does not
  depend on the rows beside it; every linear, the MLP's down projection and the LM head
  included, is quantized.
* :class:`NativeInt8Linear` on :mod:`engine.kernels.cpu_gemm_avx2`'s kernel (where the
  AVX-512 one does not build but AVX2 does): the same weights; each float32 input row
  rounded to int16 with its own scale, exact int32 sums with ``vpmaddwd``, float32 out.
* :class:`Int8DynamicLinear` (where neither builds): torch's x86 quantized engine
  (fbgemm), one
  asymmetric uint8 scale per call and float32 output. Where the CPU has VNNI
  (``avx512_vnni``/``avx_vnni``) the inputs take all 8 bits (``reduce_range=False``,
  exact there); elsewhere 7 (``reduce_range=True``): without VNNI fbgemm sums pairs of
  uint8 x int8 products in int16 (``vpmaddubsw``), which saturates on full-range inputs
  (255 * 127 * 2 > 32,767). With 8 bits on an AVX2-only EPYC the bench's greedy answers
  shared 0.15% of their tokens with vLLM's (0 of 64 identical): garbage. The down
  projection stays in the model's dtype (:data:`KEEP`): its input, SiLU(gate) * up, has
  outlier channels that one per-tensor scale cannot hold.

Why: without AMX a bfloat16 product runs on AVX-512 ``vdpbf16ps`` (32 multiply-adds per
instruction); int8 ``vpdpbusd`` does 64 at the same rate, and the weights stream half the
bytes. Measured on a Zen 4 EPYC (2 threads, AVX-512 VNNI/BF16, no AMX) by
``bench/cpu_gemm.py``, native int8 vs native bfloat16 kernels, us per call (GOP/s):
576 -> 3,072 at 64 rows 326 (694) vs 571 (397), at 512 rows 2,225 (814) vs 4,196 (432);
1,536 -> 576 at 512 rows 1,109 (817) vs 2,036 (445). Both kernels issue one 512-bit dot
product a cycle at best (a register-only loop of either runs at the same rate here).

Accuracy: ~1.1% relative error of one product (random weights). Perplexity of
SmolLM2-135M on 1,024 held-in tokens (bench/engine_quant.py's text, HF's forward):
bfloat16 40.94; native per-row int8, every linear, 41.96 (+2.5%); fbgemm per-tensor
int8, every linear 64.27 (+57%), all but down_proj 44.31 (+8.2%). Greedy output is *not*
token-identical to the bfloat16 path, so this path is labelled and the bench reports
its token agreement with bf16 (``bench/engine_quant.py``).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from engine.kernels.cpu_gemm import Int8Weight, NativeInt8Gemm, int8_gemm_here
from engine.kernels.cpu_gemm_avx2 import Avx2Int8Gemm, Avx2Int8Weight, avx2_int8_gemm_here
from engine.model.packed_linear import PAIRED, sharing_parameters
from kvtoll.cpu_info import cpu_flags

# The native int8 kernels a NativeInt8Linear runs on (module docstring).
Int8Kernel = NativeInt8Gemm | Avx2Int8Gemm


def native_int8_kernel() -> Int8Kernel | None:
    """The native int8 kernel the engine quantizes onto here: AVX512-VNNI where it
    builds, else AVX2, else None (fbgemm)."""
    return int8_gemm_here() or avx2_int8_gemm_here()


def int8_available() -> bool:
    """Whether this torch build has the x86 quantized engine's dynamic linear."""
    return "x86" in torch.backends.quantized.supported_engines or (
        "fbgemm" in torch.backends.quantized.supported_engines
    )


VNNI_FLAGS = frozenset({"avx512_vnni", "avx_vnni"})  # u8 x s8 sums in int32, not int16


def reduce_range_needed(flags: frozenset[str]) -> bool:
    """Whether fbgemm's dynamic linear must quantize inputs to 7 bits on a CPU with
    these flags (no VNNI: its int16 pair sums saturate on 8-bit inputs)."""
    return not flags & VNNI_FLAGS


def quantize_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] as a per-output-channel symmetric qint8 tensor."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    zeros = torch.zeros(w.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # torch 2.13 marks quantized tensors deprecated
        warnings.simplefilter("ignore", UserWarning)
        return torch.quantize_per_channel(w, scale.double(), zeros, 0, torch.qint8)


class Int8DynamicLinear(nn.Linear):
    """An ``nn.Linear`` (same parameters, same state dict: the float weight stays, and
    tied weights stay tied) whose forward multiplies in int8 against a packed
    quantized copy of the weight (module docstring)."""

    packed: Any  # torch's packed-parameters object (not a tensor)
    reduce_range: bool  # 7-bit inputs (a CPU without VNNI: module docstring)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, reduce_range: bool | None = None
    ) -> Int8DynamicLinear:
        """``reduce_range``: default :func:`reduce_range_needed` on this CPU."""
        if linear.weight.device.type != "cpu":
            raise ValueError(f"int8 linears run on the CPU, not {linear.weight.device}")
        if not int8_available():
            raise ValueError("this torch build has no x86/fbgemm quantized engine")
        layer = sharing_parameters(cls, linear)
        bias = None if linear.bias is None else linear.bias.detach().float()
        with torch.no_grad():
            layer.packed = torch.ops.quantized.linear_prepack(quantize_weight(linear.weight), bias)
        layer.reduce_range = (
            reduce_range_needed(cpu_flags()) if reduce_range is None else reduce_range
        )
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        out = torch.ops.quantized.linear_dynamic(rows, self.packed, self.reduce_range)
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, int8=dynamic"


class NativeInt8Linear(nn.Linear):
    """An ``nn.Linear`` (same parameters and state dict; tied weights stay tied) whose
    forward multiplies on a native int8 kernel: AVX512-VNNI
    (:class:`engine.kernels.cpu_gemm.NativeInt8Gemm`, bfloat16 in and out) or AVX2
    (:class:`engine.kernels.cpu_gemm_avx2.Avx2Int8Gemm`, float32 in and out). Weights
    per output channel int8, each input row quantized with its own scale inside the call
    (so a row's output does not depend on the rows beside it), int32 sums, output cast to
    the input's dtype; a bias is added after."""

    gemm: Int8Kernel
    quantized: Int8Weight | Avx2Int8Weight

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, gemm: Int8Kernel, paired: bool = False
    ) -> NativeInt8Linear:
        """``paired``: the weight stacks a gate and an up projection (gate rows first),
        packed so :meth:`silu_mul` runs fused (where the shape allows; the products are
        the same)."""
        if not gemm.supports(linear.weight):
            w = linear.weight
            raise ValueError(f"the native int8 kernel cannot take a {w.dtype} "
                             f"{tuple(w.shape)} weight on {w.device}")  # fmt: skip
        layer = sharing_parameters(cls, linear)
        layer.gemm = gemm
        with torch.no_grad():
            paired = paired and gemm.supports(linear.weight, paired=True)
            layer.quantized = gemm.quantize(linear.weight, paired)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != self.gemm.input_dtype or rows.stride(1) != 1:
            rows = rows.to(self.gemm.input_dtype).contiguous()
        # (the weight is the kernel's own: from_linear quantized it on this kernel)
        out = self.gemm.linear(rows, self.quantized, torch.get_num_threads())  # type: ignore[arg-type]
        out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias.to(x.dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """SiLU(gate) * up of this stacked gate/up layer's product with ``x`` [rows,
        in_features], computed inside the kernel; None where it cannot (not paired, a
        bias, not rows of the kernel's dtype)."""
        if not self.quantized.paired or self.bias is not None or x.dim() != 2:
            return None
        if x.dtype != self.gemm.input_dtype:
            return None
        rows = x if x.stride(1) == 1 else x.contiguous()
        return self.gemm.silu_mul(rows, self.quantized, torch.get_num_threads())

    def extra_repr(self) -> str:
        paired = ", gate/up paired" if self.quantized.paired else ""
        inputs = "int16" if isinstance(self.gemm, Avx2Int8Gemm) else "int8"
        return f"{super().extra_repr()}, int8=native per-row {inputs} inputs{paired}"


INT8_LINEARS = (Int8DynamicLinear, NativeInt8Linear)

# Linear layers (by attribute name) that keep the model's dtype on fbgemm's per-tensor path
# (module docstring); the native per-row path takes every linear.
KEEP = frozenset({"down_proj"})


def quantize_linears(
    model: nn.Module, keep: frozenset[str] | None = None, gemm: Int8Kernel | None = None
) -> int:
    """Replace every CPU ``nn.Linear`` in ``model`` (packed ones too; including the LM
    head; the embedding it may be tied to stays as it is) by a :class:`NativeInt8Linear`
    on ``gemm`` where it takes the weight, else by an :class:`Int8DynamicLinear`, in
    place; the number replaced. Layers whose attribute name is in ``keep`` stay; by
    default none on the native path, :data:`KEEP` on fbgemm's."""
    replaced = 0
    reduce_range = reduce_range_needed(cpu_flags())  # read once, not per layer
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (
                not isinstance(child, nn.Linear)
                or isinstance(child, INT8_LINEARS)
                or child.weight.device.type != "cpu"
            ):
                continue
            native = gemm if gemm is not None and gemm.supports(child.weight) else None
            default_keep = frozenset() if native is not None else KEEP
            if name in (default_keep if keep is None else keep):
                continue
            if native is not None:
                paired = name in PAIRED  # gate rows, then up: SiLU * up fused
                setattr(parent, name, NativeInt8Linear.from_linear(child, native, paired))
            else:
                setattr(parent, name, Int8DynamicLinear.from_linear(child, reduce_range))
            replaced += 1
    return replaced
