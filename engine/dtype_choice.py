"""Which floating-point dtype runs the model fastest on this machine.

bfloat16 halves weight and KV memory traffic, but it is only faster where the
hardware multiplies bf16 matrices natively. Measured with bench/engine_throughput.py
--dtypes and torch matmuls at the model's shapes:

* a Xeon with AMX (``amx_bf16``): bfloat16 ~1.8x faster than float32;
* an Emerald Rapids VM with ``avx512_bf16`` but AMX not exposed: bf16 dot-product
  instructions only, and bfloat16 matmuls ran at 0.55-0.75x of float32 (64-512
  rows), the engine 0.92x (87 vs 95 tokens/s);
* an AVX2-only CPU: oneDNN emulates bf16, matmuls 5-30x slower than float32.

``auto`` therefore picks bfloat16 on CUDA devices that support it and on CPUs with
bf16 matrix units (x86 ``amx_bf16``, Arm ``bf16``), float32 everywhere else.
"""

from __future__ import annotations

from pathlib import Path

DTYPES = ("float32", "bfloat16")
AUTO = "auto"
NATIVE_BF16_FLAGS = frozenset({"amx_bf16", "bf16"})


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first CPU's feature flags (x86 ``flags``, Arm ``Features``); empty if unknown."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def preferred_dtype(device: str, flags: frozenset[str] | None = None) -> str:
    """``bfloat16`` where the device has bf16 matrix units, else ``float32``."""
    if device.startswith("cuda"):
        import torch  # only here: the config module stays importable without torch

        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    if device != "cpu":
        return "float32"
    native = NATIVE_BF16_FLAGS & (cpu_flags() if flags is None else flags)
    return "bfloat16" if native else "float32"


def resolve_dtype(requested: str, device: str) -> str:
    """``requested`` itself, or :func:`preferred_dtype` for ``auto``; ValueError otherwise."""
    if requested == AUTO:
        return preferred_dtype(device)
    if requested not in DTYPES:
        raise ValueError(f"dtype must be auto, float32 or bfloat16, got {requested!r}")
    return requested
