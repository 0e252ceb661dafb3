"""Int8 linear layers whose activations are quantized per row, so a row's output never
depends on the other rows of its batch.

PyTorch's dynamic quantization (``quantize_dynamic``) picks one activation scale for the
whole input tensor: a text embedded beside a long or loud neighbour is quantized more
coarsely than the same text alone (measured on MiniLM: cosine 0.97 between a text's
vector alone and inside a 4-text batch), so its hit decision depended on its batch.
:class:`RowInt8Linear` instead quantizes each row (each token) with its own scale
``max|x_row| / 127`` and the weight per output channel; the product runs in int32
(``torch._int_mm``), which is exact, so a row's result is bit-for-bit the same whatever
else shares its batch. The speed is that of fbgemm's dynamic int8 layers.

Torch is imported inside the functions: importing this module loads nothing.
"""

from __future__ import annotations

from typing import Any


def _row_int8_linear_class() -> Any:
    import torch

    class RowInt8Linear(torch.nn.Module):
        """``y = x W^T + b`` with int8 ``W`` (per output channel) and int8 ``x`` (per row)."""

        def __init__(self, linear: Any) -> None:
            super().__init__()
            weight = linear.weight.detach().float()
            w_scale = (weight.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
            q = torch.round(weight / w_scale[:, None]).clamp(-127, 127).to(torch.int8)
            self.register_buffer("weight_t", q.t().contiguous())  # (in, out) for _int_mm
            self.register_buffer("w_scale", w_scale.contiguous())
            bias = linear.bias
            zeros = torch.zeros(weight.shape[0])
            self.register_buffer("bias", zeros if bias is None else bias.detach().float())
            self.in_features = int(weight.shape[1])
            self.out_features = int(weight.shape[0])

        def forward(self, x: Any) -> Any:
            rows = x.reshape(-1, self.in_features).float()
            scale = (rows.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-12)
            q = torch.round(rows / scale).to(torch.int8)
            weight_t: Any = self.weight_t
            acc = torch._int_mm(q, weight_t)
            out = acc.float() * scale * self.w_scale + self.bias
            return out.reshape(*x.shape[:-1], self.out_features)

    return RowInt8Linear


def quantize_linears(module: Any) -> Any:
    """``module`` with every ``torch.nn.Linear`` inside it replaced by a row-quantized
    int8 layer (in place; returned for chaining). Call on an eval-mode module."""
    import torch

    cls = _row_int8_linear_class()
    for name, child in list(module.named_children()):
        if isinstance(child, torch.nn.Linear):
            setattr(module, name, cls(child))
        else:
            quantize_linears(child)
    return module
