"""Helpers shared by the kernel launchers: device checks and compile-time choices."""

from __future__ import annotations

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def runs_interpreted(kernel: object) -> bool:
    """True when ``kernel`` was built under ``TRITON_INTERPRET=1`` (runs on CPU tensors)."""
    return isinstance(kernel, InterpretedFunction)


def check_device(kernel: object, *tensors: torch.Tensor) -> None:
    """All tensors on one device; CUDA, or CPU when ``kernel`` runs in the interpreter."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"tensors on several devices: {sorted(map(str, devices))}")
    device = next(iter(devices))
    if device.type != "cuda" and not runs_interpreted(kernel):
        raise ValueError(
            f"Triton kernels need CUDA tensors (got {device}); on CPU set TRITON_INTERPRET=1 "
            "before importing engine.kernels"
        )


def check_dtype(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name}: dtype {tensor.dtype} not in {SUPPORTED_DTYPES}")


def check_power_of_two(name: str, value: int, minimum: int) -> None:
    if value < minimum or value & (value - 1):
        raise ValueError(f"{name}={value} must be a power of two >= {minimum}")


def upcast_inputs(kernel: object, dtype: torch.dtype) -> bool:
    """Whether kernels must widen loads to float32 before arithmetic.

    The interpreter computes with numpy, which has no bfloat16: bf16 arithmetic and
    ``tl.dot`` on bf16 are wrong there, so under it bf16 tiles are widened after the
    load. Compiled kernels keep the native dtype (tensor cores).
    """
    return dtype == torch.bfloat16 and runs_interpreted(kernel)


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: exact for float32 caches, native otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


def next_power_of_2(value: int) -> int:
    return int(triton.next_power_of_2(value))
