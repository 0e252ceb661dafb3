"""Int8 linear layers for the CPU (the opt-in quantized path, ``linear_quant="int8"``).

Weights are quantized once, per output channel and symmetric (``scale = max |w| /
127`` of each row), and packed for torch's x86 quantized engine (fbgemm); each call
quantizes its input rows dynamically (per tensor, asymmetric uint8, the full 8-bit
range: ``reduce_range=False``, exact on CPUs with VNNI, whose ``vpdpbusd`` sums
int32 without the 16-bit saturation of AVX2's ``vpmaddubsw``) and multiplies in
int8 with int32 sums, dequantized to float32 and cast back to the input's dtype.

Why: without AMX a bfloat16 product runs on AVX-512 ``vdpbf16ps`` (32 multiply-adds
per instruction); int8 ``vpdpbusd`` does 64, and the weights stream half the bytes.
Measured on SmolLM2-135M's shapes at 2 threads (AMD EPYC, AVX-512 VNNI/BF16, no AMX,
best of 30, a shared machine), oneDNN-packed bf16 vs this path, ms::

    rows                     1      16     64
    576 -> 3,072 (gate/up)   0.055  0.156  0.524   bf16
                             0.035  0.098  0.315   int8
    1,536 -> 576 (down)      0.040  0.098  0.277   bf16
                             0.027  0.060  0.174   int8

Accuracy: ~1.2% relative error of one product (random weights). The MLP's down
projection stays in the model's dtype (:data:`KEEP`): its input, SiLU(gate) * up,
has outlier channels that one per-tensor input scale cannot hold. Perplexity of
SmolLM2-135M on 1,024 held-in tokens (bench/engine_quant.py's text, HF's forward):
bf16 40.9; every linear int8 64.3 (+57%); all but the LM head 63.3; all but the LM
head and down_proj 43.6 (+6.6%). Greedy output is *not* token-identical to the
bfloat16 path, so this path is labelled and the bench reports its token agreement
with bf16 (``bench/engine_quant.py``).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn


def int8_available() -> bool:
    """Whether this torch build has the x86 quantized engine's dynamic linear."""
    return "x86" in torch.backends.quantized.supported_engines or (
        "fbgemm" in torch.backends.quantized.supported_engines
    )


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

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8DynamicLinear:
        if linear.weight.device.type != "cpu":
            raise ValueError(f"int8 linears run on the CPU, not {linear.weight.device}")
        if not int8_available():
            raise ValueError("this torch build has no x86/fbgemm quantized engine")
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = linear.in_features, linear.out_features
        layer.weight = linear.weight
        layer.bias = linear.bias
        bias = None if linear.bias is None else linear.bias.detach().float()
        with torch.no_grad():
            layer.packed = torch.ops.quantized.linear_prepack(quantize_weight(linear.weight), bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        out = torch.ops.quantized.linear_dynamic(rows, self.packed, False)
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, int8=dynamic"


# Linear layers (by attribute name) that keep the model's dtype (module docstring).
KEEP = frozenset({"down_proj"})


def quantize_linears(model: nn.Module, keep: frozenset[str] = KEEP) -> int:
    """Replace every CPU ``nn.Linear`` in ``model`` (packed ones too; including the LM
    head; the embedding it may be tied to stays as it is) whose attribute name is not
    in ``keep`` by an :class:`Int8DynamicLinear`, in place; the number replaced."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (
                name not in keep
                and isinstance(child, nn.Linear)
                and not isinstance(child, Int8DynamicLinear)
                and child.weight.device.type == "cpu"
            ):
                setattr(parent, name, Int8DynamicLinear.from_linear(child))
                replaced += 1
    return replaced
