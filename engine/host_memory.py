"""The C allocator's thresholds for a process that runs a CPU engine.

torch's CPU allocator takes every tensor straight from ``malloc``. glibc serves
allocations above its mmap threshold (128 KiB at start, adjusted up to 32 MiB as
blocks are freed) with a fresh ``mmap`` and unmaps them on ``free``, and it returns
freed memory at the top of the heap to the OS past the trim threshold. A decode step's
activations ([64, 1536] float32 = 384 KiB) and a prefill chunk's (3 MiB) are above
it, so most temporaries land on new pages and every first touch is a page fault
(expensive in a VM). Measured here: an RMSNorm over [512, 576] took 817 us with the
default thresholds and 108 us with the ones below (its five ops alone: ~90 us); the
engine's non-attention model time on bench/engine_throughput.py's workload fell ~16%.

:func:`keep_tensor_memory` raises both thresholds (mmap: 32 MiB, glibc's largest;
trim: 512 MiB) so freed temporaries are reused from the heap. Process-wide and
deliberate: the memory a step used stays mapped for the next step (the same peak
the engine needs anyway). The KV cache and weights, allocated once, are above
32 MiB per tensor and stay mmapped. No-op (False) off glibc.
"""

from __future__ import annotations

import ctypes
import platform

MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 512 << 20
_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3


def keep_tensor_memory() -> bool:
    """Raise glibc's mmap and trim thresholds; whether both were set."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
