"""Which floating-point dtype runs the model fastest on this machine.

bfloat16 halves weight and KV memory traffic, but it is only faster where the
hardware computes in it natively. Measured with bench/engine_throughput.py
--dtypes: on a CPU with AVX512-BF16 bfloat16 ran ~1.8x faster than float32; on
an AVX2-only CPU (no bf16 instructions) oneDNN emulates it and bfloat16 matmuls
ran 5-30x slower than float32. ``auto`` therefore picks bfloat16 on CUDA devices
that support it and on CPUs that advertise native bf16 (x86 ``avx512_bf16`` or
``amx_bf16``, Arm ``bf16``), float32 everywhere else.
"""

from __future__ import annotations

from pathlib import Path

DTYPES = ("float32", "bfloat16")
AUTO = "auto"
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


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
    """``bfloat16`` where the device computes in it natively, else ``float32``."""
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
