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
  bf16 was 2.7x *slower* than float32 at 64 rows there;
* an Emerald Rapids VM with ``avx512_bf16`` and AMX hidden: bf16 matmuls through
  ``F.linear`` at 0.55-0.75x of float32 (64-512 rows), measured before the engine
  packed bf16 weights (packed bf16 was not measured there);
* an AVX2-only CPU: oneDNN emulates bf16, matmuls 5-30x slower than float32;
* an Emerald Rapids VM whose CPUID hides both AMX and ``avx512_bf16``: oneDNN packs
  bf16 weights but emulates the product, 1.9-4.4x slower than float32 at 8-512 rows.
  There an explicit ``bfloat16`` keeps bf16 weights, KV cache and activations and
  multiplies its linears in float32 (:func:`engine.model.packed_linear.pack_linears`'
  ``upcast_bf16``): the engine's bf16 throughput then matches float32's (184 vs 181
  tokens/s on the 64 requests, against 73 emulated).

``auto`` therefore picks bfloat16 on CUDA devices that support it and on CPUs with
bf16 matrix units (x86 ``amx_bf16``, Arm ``bf16``) where oneDNN packs bf16 weights;
on CPUs with bf16 dot products only (``avx512_bf16``) it measures a packed product in
both dtypes (a few ms) and takes bfloat16 only if that is clearly faster; float32
everywhere else. That measurement is taken once per machine and persisted
(:mod:`engine.dtype_probe`), so every worker started on one machine decides alike
(a fresh timing on a busy machine could land on either side of the threshold); the
choice and its reason are logged.
"""

from __future__ import annotations

import logging

from kvtoll.cpu_info import cpu_flags, cpu_model

log = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16")
AUTO = "auto"
MATRIX_BF16_FLAGS = frozenset({"amx_bf16", "bf16"})  # bf16 matrix units: x86 AMX, Arm BFMMLA
DOT_BF16_FLAGS = frozenset({"avx512_bf16"})  # bf16 dot-product instructions only
# Where only dot-product instructions exist the evidence disagrees (Zen 4 1.3-1.9x,
# the Emerald Rapids VM 0.55-0.75x), so there bfloat16 must measure at least this much
# faster (engine.model.packed_linear.packed_bf16_speedup) to be chosen.
BF16_MIN_SPEEDUP = 1.1


def persisted_bf16_speedup() -> float:
    """This machine's packed bf16 speedup, measured once and read back on every start."""
    import torch  # only on a bf16-capable CPU

    from engine import dtype_probe
    from engine.model import packed_linear

    key = dtype_probe.machine_key(cpu_flags(), cpu_model(), torch.__version__)
    result = dtype_probe.persisted_speedup(key, packed_linear.packed_bf16_speedup)
    log.info("dtype auto: packed bf16 measured %.2fx float32 (%s %s)", result.bf16_speedup,
             "now, kept in" if result.measured_now else "earlier, read from", result.path)
    return result.bf16_speedup


def native_bf16(device: str, flags: frozenset[str] | None = None) -> bool:
    """Whether ``device`` computes in bfloat16 natively (CUDA with bf16 support, or a
    CPU with bf16 instructions); ``flags``: the CPU's, default :func:`cpu_flags`."""
    if device.startswith("cuda"):
        import torch  # only here: the config module stays importable without torch

        return bool(torch.cuda.is_bf16_supported())
    if device != "cpu":
        return False
    return bool((MATRIX_BF16_FLAGS | DOT_BF16_FLAGS) & (cpu_flags() if flags is None else flags))


def preferred_dtype(
    device: str,
    flags: frozenset[str] | None = None,
    packs_bf16: bool | None = None,
    bf16_speedup: float | None = None,
) -> str:
    """``bfloat16`` where ``device`` computes in bf16 natively and, on a CPU, oneDNN
    packs bf16 weights (``packs_bf16``) and, without matrix units, packed bf16 measures
    at least :data:`BF16_MIN_SPEEDUP` times faster than float32 (``bf16_speedup``);
    else ``float32``. ``flags``, ``packs_bf16`` and ``bf16_speedup`` default to what
    this machine reads and measures now."""
    if device == "cpu" and flags is None:
        flags = cpu_flags()  # read once
    if not native_bf16(device, flags):
        return "float32"
    if device != "cpu":
        return "bfloat16"
    from engine.model import packed_linear  # imports torch: only on a bf16-capable CPU

    if not (packed_linear.onednn_bf16_packing_works() if packs_bf16 is None else packs_bf16):
        return "float32"
    if MATRIX_BF16_FLAGS & (flags or frozenset()):
        return "bfloat16"
    speedup = persisted_bf16_speedup() if bf16_speedup is None else bf16_speedup
    return "bfloat16" if speedup >= BF16_MIN_SPEEDUP else "float32"


def resolve_dtype(requested: str, device: str) -> str:
    """``requested`` itself, or :func:`preferred_dtype` for ``auto``; ValueError otherwise."""
    if requested == AUTO:
        chosen = preferred_dtype(device)
        log.info("dtype auto: %s on %s", chosen, device)
        return chosen
    if requested not in DTYPES:
        raise ValueError(f"dtype must be auto, float32 or bfloat16, got {requested!r}")
    return requested
