"""Helpers shared by the kernel launchers: device checks and compile-time choices."""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class LaunchOptions:
    """Triton's per-launch compile options. ``num_warps`` None: the kernel's default
    (each kernel module's ``default_num_warps``); ``num_stages`` None: Triton's
    (3 software-pipeline stages on CUDA). Benchmarks sweep them; the engine uses defaults."""

    num_warps: int | None = None
    num_stages: int | None = None

    def __post_init__(self) -> None:
        if self.num_warps is not None:
            check_power_of_two("num_warps", self.num_warps, 1)
        if self.num_stages is not None and self.num_stages < 1:
            raise ValueError(f"num_stages={self.num_stages} must be >= 1")

    def kwargs(self, default_num_warps: int) -> dict[str, int]:
        """Launch keyword arguments: the warps (``default_num_warps`` unless set) and the
        stages where set."""
        options = {"num_warps": self.num_warps or default_num_warps}
        if self.num_stages is not None:
            options["num_stages"] = self.num_stages
        return options


DEFAULT_LAUNCH = LaunchOptions()


@dataclass(frozen=True)
class KVScales:
    """float32 dequantization scales of an int8 cache pair: [num_blocks, block_size, Hkv]
    (one per token slot and KV head), so ``x = int8 * scale``."""

    k: torch.Tensor
    v: torch.Tensor


def check_kv_cache(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scales: KVScales | None
) -> None:
    """The pool layout of engine.attention.base, in q's dtype or int8 with scales."""
    check_dtype("q", q)
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} must match")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if scales is None and not (k_cache.dtype == v_cache.dtype == q.dtype):
        raise ValueError(f"dtypes q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype} must match")
    if scales is not None:
        check_int8_scales(k_cache, v_cache, scales)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    check_power_of_two("block_size", block_size, 8)
    check_power_of_two("head_dim", head_dim, 16)
    if q.dim() != 3 or q.shape[2] != head_dim or q.shape[1] % num_kv_heads:
        raise ValueError(
            f"q {tuple(q.shape)}: want [T, H, {head_dim}] with H % {num_kv_heads} == 0"
        )
    if q.stride(2) != 1:
        raise ValueError("q needs a unit stride in head_dim")


def check_int8_scales(k_cache: torch.Tensor, v_cache: torch.Tensor, scales: KVScales) -> None:
    if not (k_cache.dtype == v_cache.dtype == torch.int8):
        raise ValueError(f"scaled caches must be int8, got {k_cache.dtype} / {v_cache.dtype}")
    for name, t in (("k", scales.k), ("v", scales.v)):
        if t.shape != k_cache.shape[:3] or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{name} scales {tuple(t.shape)} {t.dtype}: want contiguous float32 "
                             f"{tuple(k_cache.shape[:3])}")
