"""Which floating-point dtype runs the model fastest on this machine.

bfloat16 halves weight and KV memory traffic, but it is only faster where the
hardware computes in bf16 natively *and* the linear layers multiply against weights
packed once (:mod:`engine.model.packed_linear`): ``F.linear`` on bf16 CPU tensors
re-lays the weight out for the bf16 kernels on every call. Measured with
bench/engine_throughput.py --dtypes and torch matmuls at the model's shapes:

* a Xeon with AMX (``amx_bf16``): bfloat16 ~1.8x faster than float32;
* an AMD EPYC (Zen 4) with ``avx512_bf16`` (bf16 dot-product instructions, no AMX):
  packed bf16 layers 1.3-1.9x faster than packed float32 at 1-512 rows; the engine
  1.67x on --dtypes (106 vs 63 tokens/s) and 1.29-1.42x on the bench's 64 requests
  (194 and 204 vs 136 and 158 tokens/s, alternating runs); unpacked ``F.linear`` in
  bf16 was 2.7x *slower* than float32 at 64 rows there. (An Emerald Rapids VM with
  ``avx512_bf16`` measured bf16 at 0.55-0.75x of float32 before the engine packed
  bf16 weights: that was ``F.linear``.)
* an AVX2-only CPU: oneDNN emulates bf16, matmuls 5-30x slower than float32.

``auto`` therefore picks bfloat16 on CUDA devices that support it, and on CPUs with
bf16 instructions (x86 ``amx_bf16`` or ``avx512_bf16``, Arm ``bf16``) where oneDNN
packs bf16 weights; float32 everywhere else.
"""

from __future__ import annotations

from pathlib import Path

DTYPES = ("float32", "bfloat16")
AUTO = "auto"
NATIVE_BF16_FLAGS = frozenset({"amx_bf16", "avx512_bf16", "bf16"})


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


def native_bf16(device: str, flags: frozenset[str] | None = None) -> bool:
    """Whether ``device`` computes in bfloat16 natively (CUDA with bf16 support, or a
    CPU with bf16 instructions); ``flags``: the CPU's, default :func:`cpu_flags`."""
    if device.startswith("cuda"):
        import torch  # only here: the config module stays importable without torch

        return bool(torch.cuda.is_bf16_supported())
    if device != "cpu":
        return False
    return bool(NATIVE_BF16_FLAGS & (cpu_flags() if flags is None else flags))


def preferred_dtype(
    device: str, flags: frozenset[str] | None = None, packs_bf16: bool | None = None
) -> str:
    """``bfloat16`` where ``device`` computes in bf16 natively and, on a CPU, oneDNN
    packs bf16 weights (``packs_bf16``, default: probed now); else ``float32``."""
    if not native_bf16(device, flags):
        return "float32"
    if device == "cpu":
        if packs_bf16 is None:
            from engine.model.packed_linear import onednn_bf16_packing_works  # imports torch

            packs_bf16 = onednn_bf16_packing_works()
        if not packs_bf16:
            return "float32"
    return "bfloat16"


def resolve_dtype(requested: str, device: str) -> str:
    """``requested`` itself, or :func:`preferred_dtype` for ``auto``; ValueError otherwise."""
    if requested == AUTO:
        return preferred_dtype(device)
    if requested not in DTYPES:
        raise ValueError(f"dtype must be auto, float32 or bfloat16, got {requested!r}")
    return requested
