"""Linear layers over MKL-packed weights (CPU, float32).

``torch.nn.functional.linear`` on CPU calls MKL's sgemm, which re-packs the weight
matrix into its blocked layout on every call. With the few rows of a decode step
that packing costs as much as the multiplication. MKL can pack a weight once
(``cblas_sgemm_pack``) and multiply against the packed copy for any number of rows
(torch's ``mkl::_mkl_linear``). Measured on this project's shapes (576 <-> 1536,
576 -> 576/192, 2 threads), one layer's seven projections:

    rows        1     8     16    40    64    128   512
    speedup   1.0x  1.7x  1.9x  1.4x  1.3x  1.1x  1.05x

The packed copy costs as much memory as the weight (RSS measured; torch reports a
larger numel for it, but only the packed bytes are touched). Results equal
``F.linear``'s to float32 rounding. The packed copy is taken when :func:`pack_linears`
runs: the weights must not change afterwards (the engine never changes them).
"""

from __future__ import annotations

import torch
from torch import nn


def mkl_packing_available() -> bool:
    """Whether this torch build has MKL and its packed linear op."""
    return bool(torch.backends.mkl.is_available()) and hasattr(torch.ops.mkl, "_mkl_linear")


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` (same parameters, same state dict) that multiplies against an
    MKL-packed copy of its weight."""

    packed: torch.Tensor

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> PackedLinear:
        """A packed layer sharing ``linear``'s weight and bias (tied weights stay tied)."""
        if linear.weight.device.type != "cpu" or linear.weight.dtype != torch.float32:
            raise ValueError(
                f"MKL packing needs float32 CPU weights, got {linear.weight.dtype} on "
                f"{linear.weight.device}"
            )
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = linear.in_features, linear.out_features
        layer.weight = linear.weight
        layer.bias = linear.bias
        with torch.no_grad():
            # The batch size is only MKL's blocking hint; forward passes each call's rows.
            packed = torch.ops.mkl._mkl_reorder_linear_weight(linear.weight.detach(), 64)
        layer.register_buffer("packed", packed, persistent=False)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and self.weight.requires_grad:
            return super().forward(x)  # the packed op has no autograd formula
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.mkl._mkl_linear(rows, self.packed, self.weight, self.bias, rows.shape[0])
        return out.view(*x.shape[:-1], self.out_features)


def pack_linears(model: nn.Module) -> int:
    """Replace every float32 CPU ``nn.Linear`` in ``model`` by a :class:`PackedLinear`
    (in place); the number replaced."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == torch.float32 \
                    and child.weight.device.type == "cpu":
                setattr(parent, name, PackedLinear.from_linear(child))
                replaced += 1
    return replaced
