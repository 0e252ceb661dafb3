"""Int8 linear layers whose activations are quantized per row, so a row's output never
depends on the other rows of its batch.

PyTorch's dynamic quantization (``quantize_dynamic``) picks one activation scale for the
whole input tensor: a text embedded beside a long or loud neighbour is quantized more
coarsely than the same text alone (measured on MiniLM: cosine 0.97 between a text's
vector alone and inside a 4-text batch), so its hit decision depended on its batch.
:class:`RowInt8Linear` instead quantizes each row (each token) with its own scale
``max|x_row| / 127`` and the weight per output channel; the integer product is exact,
so a row's result is bit-for-bit the same whatever else shares its batch.

Two ways to the same exact int32 sums, picked per CPU (:func:`int8_products_native`):

* ``torch._int_mm`` (oneDNN's int8 matmul) where the CPU has int8 dot-product
  instructions (x86 VNNI or AMX-INT8): fbgemm's speed.
* Elsewhere ``torch._int_mm`` falls back to a scalar loop: on an AVX2-only AMD EPYC a
  [256, 384] x [384, 1536] product took 120-180 ms against float32's 3-6 ms (~30x), and
  the pair encoder embedded ~5 texts a second. There the int8 values multiply as float32
  in chunks of at most :data:`EXACT_CHUNK` inputs: a product of two int8 values is at
  most 127 x 127 in magnitude, so every partial sum of a chunk, in any order, is an
  integer below 2^24 and exact in float32; each chunk's sums convert to int32 exactly
  and add in int32 -- the same int32 sums as ``torch._int_mm``, bit for bit.

Torch is imported inside the functions: importing this module loads nothing.
"""

from __future__ import annotations

from typing import Any

from kvtoll.cpu_info import cpu_flags

# x86 int8 dot products torch's _int_mm (oneDNN) multiplies with: AVX512-VNNI, AVX-VNNI, AMX.
INT8_PRODUCT_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})
# Inputs per float32 chunk: chunk x 127 x 127 <= 2^24, so every partial sum is exact.
EXACT_CHUNK = (1 << 24) // (127 * 127)


def int8_products_native(flags: frozenset[str] | None = None) -> bool:
    """Whether ``torch._int_mm`` runs on int8 dot-product instructions on this CPU
    (``flags``: default :func:`kvtoll.cpu_info.cpu_flags`)."""
    return bool(INT8_PRODUCT_FLAGS & (cpu_flags() if flags is None else flags))


def _row_int8_linear_class() -> Any:
    import torch

    class RowInt8Linear(torch.nn.Module):
        """``y = x W^T + b`` with int8 ``W`` (per output channel) and int8 ``x`` (per
        row); ``int_mm``: the int32 sums by ``torch._int_mm``, else by exact float32
        chunks (module docstring)."""

        def __init__(self, linear: Any, int_mm: bool = True) -> None:
            super().__init__()
            weight = linear.weight.detach().float()
            w_scale = (weight.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
            q = torch.round(weight / w_scale[:, None]).clamp(-127, 127).to(torch.int8)
            self.int_mm = int_mm
            self.in_features = int(weight.shape[1])
            self.out_features = int(weight.shape[0])
            if int_mm:
                self.register_buffer("weight_t", q.t().contiguous())  # (in, out) for _int_mm
                self.chunks = 0
            else:  # the int8 values as float32, (in, out), EXACT_CHUNK inputs a chunk
                q_t = q.t().float()
                starts = range(0, self.in_features, EXACT_CHUNK)
                for i, start in enumerate(starts):
                    chunk = q_t[start : start + EXACT_CHUNK].contiguous()
                    self.register_buffer(f"weight_chunk_{i}", chunk)
                self.chunks = len(starts)
            self.register_buffer("w_scale", w_scale.contiguous())
            bias = linear.bias
            zeros = torch.zeros(weight.shape[0])
            self.register_buffer("bias", zeros if bias is None else bias.detach().float())

        def forward(self, x: Any) -> Any:
            rows = x.reshape(-1, self.in_features).float()
            scale = (rows.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-12)
            q = torch.round(rows / scale).to(torch.int8)
            if self.int_mm:
                weight_t: Any = self.weight_t
                acc = torch._int_mm(q, weight_t)
            else:
                values = q.float()
                acc = torch.zeros((q.shape[0], self.out_features), dtype=torch.int32)
                for i in range(self.chunks):
                    chunk: Any = getattr(self, f"weight_chunk_{i}")
                    start = i * EXACT_CHUNK
                    part = values[:, start : start + chunk.shape[0]] @ chunk
                    acc = acc + part.to(torch.int32)  # an exact integer: converts exactly
            out = acc.float() * scale * self.w_scale + self.bias
            return out.reshape(*x.shape[:-1], self.out_features)

    return RowInt8Linear


def quantize_linears(module: Any, int_mm: bool | None = None) -> Any:
    """``module`` with every ``torch.nn.Linear`` inside it replaced by a row-quantized
    int8 layer (in place; returned for chaining). Call on an eval-mode module.
    ``int_mm``: multiply by ``torch._int_mm`` (default: where
    :func:`int8_products_native`), else by exact float32 chunks; the same outputs."""
    import torch

    if int_mm is None:
        int_mm = int8_products_native()  # read once, not per layer
    cls = _row_int8_linear_class()
    for name, child in list(module.named_children()):
        if isinstance(child, torch.nn.Linear):
            setattr(module, name, cls(child, int_mm))
        else:
            quantize_linears(child, int_mm)
    return module
