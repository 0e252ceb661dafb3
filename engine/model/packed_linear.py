"""Linear layers over pre-packed weights (CPU; float32, and bfloat16 with oneDNN).

``torch.nn.functional.linear`` on CPU calls MKL's sgemm, which re-packs the weight
matrix into its blocked layout on every call. With the few rows of a decode step
that packing costs as much as the multiplication. Both of torch's CPU matrix
libraries can pack a weight once and multiply against the packed copy for any
number of rows:

- ``onednn``: oneDNN's blocked layout (``mkldnn::_reorder_linear_weight``) and its
  matmul (``mkldnn::_linear_pointwise``, the op torch's compiler emits for frozen
  CPU linears). Preferred where torch has it.
- ``mkl``: MKL's ``cblas_sgemm_pack`` (``mkl::_mkl_reorder_linear_weight``) and
  ``mkl::_mkl_linear``.

Measured on this project's shapes (one layer's seven projections, 576 <-> 1536 and
576 -> 576/192; the 576 -> 49,152 LM head) at 2 threads, median milliseconds of one
run (AMD EPYC, AVX2)::

    rows               1      8      24     40     64     512
    F.linear layer     0.55   1.62   2.12   2.89   4.17   23.7
    mkl      layer     0.59   1.39   1.81   2.41   4.06   26.9
    onednn   layer     0.74   0.99   1.63   2.07   3.56   27.5
    F.linear LM head   13.2   29.5   38.8   44.5   71.9   472
    mkl      LM head   6.98   27.9   28.8   39.8   66.6   380
    onednn   LM head   8.06   11.5   16.8   24.8   29.3   326

End to end (bench/engine_throughput.py's 64 requests, engine only, alternating runs):
mkl 77-80 output tokens/s, onednn 86-87, every sequence token-identical.

Results: ``mkl`` equals ``F.linear`` bit for bit; ``onednn`` sums in another order
(differences at float32 rounding, ~4e-6 of the outputs' scale on these shapes).
``onednn`` is batch-invariant: a row's result does not depend on how many other rows
are multiplied with it (checked for 1 to 300 rows), so a request's logits do not
depend on its batch. ``mkl`` (like ``F.linear``) is not: 1-7 rows take another path.
The packed copy costs as much memory as the weight (RSS measured). It is taken when
:func:`pack_linears` runs: the weights must not change afterwards (the engine never
changes them).

bfloat16 (``onednn`` only; MKL has no bf16 sgemm): ``F.linear`` on bf16 CPU tensors
runs oneDNN's matmul too, and reorders the weight for the AMX tiles on every call.
Packing once gives bit-identical results (checked for 1 to 300 rows), so a bf16
engine's tokens do not change, only its speed. Medians at 2 threads, in ms, Xeon with
AMX (``amx_bf16``)::

    rows                  1      8      32     64     512
    F.linear bf16 layer   0.53   0.53   0.61   0.85   2.38
    onednn   bf16 layer   0.37   0.37   0.45   0.58   2.58
    F.linear bf16 head    2.01   2.27   3.36   5.97   34.6
    onednn   bf16 head    1.33   1.37   1.86   2.14   34.4
    (float32 onednn layer 0.50   0.69   1.22   1.98   11.4 on the same CPU)

Neither bf16 path is batch-invariant there (16 rows take another blocking). Where the
CPU lacks bf16 instructions oneDNN may not build a bf16 primitive at all, so bf16
packing is probed once (:func:`onednn_bf16_packing_works`) rather than assumed.

Where it does build one without bf16 instructions, it emulates: each bf16 value is
widened inside the kernel and the products are summed in float32 -- the arithmetic of
a float32 product of the widened values, several times slower. A bf16 layer can
therefore multiply in float32 (``compute_dtype``, :func:`pack_linears`'
``upcast_bf16``): the packed copy is the weight widened exactly, inputs are widened and
outputs rounded back to bfloat16 once, and rows are batch-invariant as in float32.
One layer's projections (stacked q/k/v, o, stacked gate/up, down), best of 3x9, ms at
2 threads, a 2-core Emerald Rapids VM whose CPUID hides AMX and AVX-512 BF16::

    rows                   1      2      4      8      16     64     512
    float32                0.537  0.462  0.560  0.738  0.983  2.388  14.66
    bfloat16 (emulated)    0.379  0.635  0.929  1.413  2.396  8.507  64.53
    bfloat16 in float32    0.480  0.589  0.611  0.782  1.076  2.186  16.17

The emulated product wins only at one row, where it streams half the weight bytes.
"""

from __future__ import annotations

import time
from typing import Literal, Protocol, TypeVar

import torch
from torch import nn

PackKind = Literal["onednn", "mkl"]
# Layers (by attribute name) that stack a gate and an up projection, gate rows first
# (engine.model.llama's LlamaMLP.gate_up_proj): the native kernels pack them as pairs
# and can return SiLU(gate) * up directly.
PAIRED = frozenset({"gate_up_proj"})


class NativeGemm(Protocol):
    """A native bfloat16 linear kernel (:class:`engine.kernels.cpu_gemm.NativeGemm`): a
    Protocol, since importing that module here would close an import circle through
    engine.dtype_choice (tests/test_import_graph.py)."""

    def supports(self, weight: torch.Tensor, paired: bool = False) -> bool: ...

    def pack(self, weight: torch.Tensor, paired: bool = False) -> torch.Tensor: ...

    def linear(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        out_features: int,
        threads: int,
        paired: bool = False,
    ) -> torch.Tensor: ...

    def silu_mul(
        self, x: torch.Tensor, packed: torch.Tensor, out_features: int, threads: int
    ) -> torch.Tensor: ...


_Linear = TypeVar("_Linear", bound=nn.Linear)


def sharing_parameters(cls: type[_Linear], linear: nn.Linear) -> _Linear:
    """A ``cls`` (an ``nn.Linear`` subclass) holding ``linear``'s own weight and bias
    parameters (same state dict; tied weights stay tied), no new ones initialised; the
    caller adds the rest of its state."""
    layer = cls.__new__(cls)
    nn.Module.__init__(layer)
    layer.in_features, layer.out_features = linear.in_features, linear.out_features
    layer.weight = linear.weight
    layer.bias = linear.bias
    return layer


# The row count each library is told to expect when packing: only a blocking hint
# (forward passes each call's rows); 1 to 256 measured alike.
_ROWS_HINT = 64


def onednn_packing_available() -> bool:
    """Whether this torch build has oneDNN and its packed linear ops."""
    ops = torch.ops.mkldnn
    return (
        bool(torch.backends.mkldnn.is_available())
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


def mkl_packing_available() -> bool:
    """Whether this torch build has MKL and its packed linear op."""
    return bool(torch.backends.mkl.is_available()) and hasattr(torch.ops.mkl, "_mkl_linear")


def onednn_bf16_packing_works() -> bool:
    """Whether oneDNN packs and multiplies a bfloat16 weight here, matching F.linear."""
    if not onednn_packing_available():
        return False
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 32, generator=gen).to(torch.bfloat16)
    x = torch.randn(3, 32, generator=gen).to(torch.bfloat16)
    try:
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, _ROWS_HINT)
            out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except RuntimeError:  # no bf16 primitive on this CPU
        return False
    expected = torch.nn.functional.linear(x, weight)
    return bool(torch.allclose(out.float(), expected.float(), rtol=2e-2, atol=2e-2))


def packable_dtypes(kind: PackKind) -> frozenset[torch.dtype]:
    """The weight dtypes ``kind`` can pack on this machine."""
    if kind == "mkl":
        return frozenset({torch.float32}) if mkl_packing_available() else frozenset()
    if not onednn_packing_available():
        return frozenset()
    if onednn_bf16_packing_works():
        return frozenset({torch.float32, torch.bfloat16})
    return frozenset({torch.float32})


def best_packing() -> PackKind | None:
    """The faster packing this torch build offers, ``None`` if neither."""
    if onednn_packing_available():
        return "onednn"
    if mkl_packing_available():
        return "mkl"
    return None


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` (same parameters, same state dict) that multiplies against a
    packed copy of its weight."""

    packed: torch.Tensor
    kind: PackKind
    compute_dtype: torch.dtype
    # engine.model.native_linear: up to native_max_rows rows multiply on the native
    # bfloat16 kernel against its own packed copy instead (use_native)
    native: NativeGemm | None = None
    native_packed: torch.Tensor | None = None
    native_max_rows: int = 0
    native_paired: bool = False  # packed as a gate/up pair: silu_mul can run fused

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        kind: PackKind,
        dtypes: frozenset[torch.dtype] | None = None,
        compute_dtype: torch.dtype | None = None,
    ) -> PackedLinear:
        """A packed layer sharing ``linear``'s weight and bias (tied weights stay tied).
        ``dtypes``: :func:`packable_dtypes` of ``kind``, when the caller has it already.
        ``compute_dtype``: the dtype the product runs in, default the weight's; float32
        for a bfloat16 weight packs an exact float32 copy of it and multiplies in float32
        (:func:`pack_linears`' ``upcast_bf16``)."""
        available = onednn_packing_available() if kind == "onednn" else mkl_packing_available()
        if not available:
            raise ValueError(f"this torch build cannot pack weights with {kind}")
        dtypes = packable_dtypes(kind) if dtypes is None else dtypes
        compute = linear.weight.dtype if compute_dtype is None else compute_dtype
        widened = (compute, linear.weight.dtype) == (torch.float32, torch.bfloat16)
        if compute != linear.weight.dtype and not widened:
            raise ValueError(
                f"a {linear.weight.dtype} weight computes in its own dtype or, if bfloat16, "
                f"in float32; got {compute}"
            )
        if compute != linear.weight.dtype and kind != "onednn":
            raise ValueError("only onednn packing multiplies a bfloat16 weight in float32")
        if linear.weight.device.type != "cpu" or compute not in dtypes:
            names = " or ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
            raise ValueError(
                f"{kind} packing needs {names} CPU weights here, got {linear.weight.dtype} "
                f"on {linear.weight.device}"
            )
        layer = sharing_parameters(cls, linear)
        layer.kind = kind
        layer.compute_dtype = compute
        with torch.no_grad():
            weight = linear.weight.detach().to(compute)  # bf16 -> float32 is exact
            if kind == "onednn":
                packed = torch.ops.mkldnn._reorder_linear_weight(weight, _ROWS_HINT)
            else:
                packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, _ROWS_HINT)
        layer.register_buffer("packed", packed, persistent=False)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and self.weight.requires_grad:
            return super().forward(x)  # the packed ops have no autograd formula
        rows = x.reshape(-1, self.in_features)
        if (
            self.native is not None
            and self.native_packed is not None
            and rows.shape[0] <= self.native_max_rows
            and rows.dtype == torch.bfloat16
        ):
            rows = rows if rows.stride(1) == 1 else rows.contiguous()
            out = self.native.linear(rows, self.native_packed, self.out_features,
                                     torch.get_num_threads(), self.native_paired)  # fmt: skip
            return out.view(*x.shape[:-1], self.out_features)
        if self.packed.numel() == 0:  # use_native dropped the oneDNN copy: not bfloat16 rows
            return super().forward(x)
        upcast = rows.dtype != self.compute_dtype
        if upcast:
            rows = rows.to(self.compute_dtype)
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        if self.kind == "onednn":
            out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, bias, "none", [], "")
        else:
            out = torch.ops.mkl._mkl_linear(rows, self.packed, self.weight, bias, rows.shape[0])
        if upcast:
            out = out.to(x.dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """SiLU(gate) * up of this stacked gate/up layer's product with ``x`` [rows,
        in_features] (its output's halves), computed inside the native kernel without
        the [rows, out_features] product; None where this call does not run there (not
        paired, too many rows, not bfloat16)."""
        if (
            self.native is None
            or self.native_packed is None
            or not self.native_paired
            or x.dim() != 2
            or x.shape[0] > self.native_max_rows
            or x.dtype != torch.bfloat16
            or (torch.is_grad_enabled() and self.weight.requires_grad)
        ):
            return None
        rows = x if x.stride(1) == 1 else x.contiguous()
        return self.native.silu_mul(rows, self.native_packed, self.out_features,
                                    torch.get_num_threads())  # fmt: skip

    def can_use_native(self, gemm: NativeGemm) -> bool:
        """Whether :meth:`use_native` takes this layer: a bfloat16 product without bias
        of a weight ``gemm`` can pack."""
        return (
            self.bias is None
            and self.compute_dtype == self.weight.dtype == torch.bfloat16
            and gemm.supports(self.weight)
        )

    def use_native(
        self, gemm: NativeGemm, max_rows: int, keep_onednn: bool = True, paired: bool = False
    ) -> None:
        """Multiply calls of up to ``max_rows`` rows on ``gemm`` (:meth:`can_use_native`);
        without ``keep_onednn`` (every call native) the oneDNN copy is freed, and a call
        that is not bfloat16 runs ``F.linear``. ``paired``: the weight stacks a gate and
        an up projection (gate rows, then up rows), packed so :meth:`silu_mul` runs fused
        where the kernel takes it (same products otherwise)."""
        paired = paired and gemm.supports(self.weight, paired=True)
        if not self.can_use_native(gemm):
            raise ValueError(f"{self.extra_repr()}: not a bfloat16 layer without bias that "
                             f"the native kernel can pack")  # fmt: skip
        self.native_packed = gemm.pack(self.weight, paired)
        self.native, self.native_max_rows, self.native_paired = gemm, max_rows, paired
        if not keep_onednn:
            self.packed = torch.empty(0, dtype=self.weight.dtype)

    def extra_repr(self) -> str:
        compute = "" if self.compute_dtype == self.weight.dtype else f" in {self.compute_dtype}"
        native = f", native up to {self.native_max_rows} rows" if self.native else ""
        return f"{super().extra_repr()}, packed={self.kind}{compute}{native}"


def pack_linears(model: nn.Module, kind: PackKind, upcast_bf16: bool = False) -> int:
    """Replace every CPU ``nn.Linear`` in ``model`` whose dtype ``kind`` can pack here
    (:func:`packable_dtypes`) by a :class:`PackedLinear` (in place); the number replaced.

    ``upcast_bf16``: bfloat16 layers multiply in float32 against a packed float32 copy
    of their weight, inputs widened and outputs rounded back to bfloat16 -- for a CPU
    without bf16 instructions, where oneDNN emulates a bf16 product (each bf16 value
    widened inside the kernel, products summed in float32: the same arithmetic, in
    another order) 1.9-4.4x slower than its float32 one at 8-512 rows (module docstring)."""
    dtypes = packable_dtypes(kind)
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child.weight.device.type != "cpu":
                continue
            compute = child.weight.dtype
            if upcast_bf16 and compute == torch.bfloat16 and kind == "onednn":
                compute = torch.float32
            if compute in dtypes:
                setattr(parent, name, PackedLinear.from_linear(child, kind, dtypes, compute))
                replaced += 1
    return replaced


def packed_bf16_speedup(rows: int = 64, repeats: int = 7) -> float:
    """How many times faster a oneDNN-packed bfloat16 product is than a packed float32
    one here: best of ``repeats`` of ``[rows, 576] x [576, 1,536]`` (SmolLM2-135M's MLP
    projection) through :class:`PackedLinear` in each dtype; best-of, not mean, so a
    busy neighbour does not decide. Needs :func:`onednn_bf16_packing_works`."""
    if rows < 1 or repeats < 1:
        raise ValueError(f"rows and repeats must be positive, got {rows}, {repeats}")
    gen = torch.Generator().manual_seed(0)
    linear = torch.nn.utils.skip_init(nn.Linear, 576, 1536, bias=False)  # global RNG untouched
    with torch.no_grad():
        linear.weight.copy_(torch.randn(1536, 576, generator=gen))
    x = torch.randn(rows, 576, generator=gen)
    best: dict[torch.dtype, float] = {}
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            layer = PackedLinear.from_linear(linear.to(dtype), "onednn", frozenset({dtype}))
            rows_in = x.to(dtype)
            layer(rows_in)  # warm-up
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                layer(rows_in)
                times.append(time.perf_counter() - start)
            best[dtype] = min(times)
    return best[torch.float32] / best[torch.bfloat16]
