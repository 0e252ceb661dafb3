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

:func:`advise_huge_pages` asks Linux to back one large region with transparent huge
pages (2 MiB) where the machine leaves that to the program (``madvise`` mode, as here):
the KV cache, which decode attention reads in ~6 KiB blocks scattered over gigabytes
(each block a TLB miss on 4 KiB pages). Measured on a Zen 4 EPYC, 2 threads, bf16: 64
decode rows x 24,723 tokens x 30 layers 35.1 -> 33.0 ms (float32 products 39.4 ->
38.3). The LM head's packed weight (56 MiB, streamed every step) gained as much on huge
pages (its product 10.1-10.7 -> 9.3 ms at 64 rows, all of glibc's allocations on huge
pages), but oneDNN's packed tensors expose no address to advise. Cost: the kernel finds
2 GiB of huge pages once per start (compacting memory where it must: 2.7-4.5 s the first
time on this VM, 0.3 s once pages were free, against ~1 s to zero 4 KiB pages).
"""

from __future__ import annotations

import ctypes
import platform

MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 512 << 20
_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14  # Linux's madvise advice numbers (mman-common.h)
_MADV_COLLAPSE = 25  # Linux 6.1+


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


def advise_huge_pages(address: int, nbytes: int, collapse: bool = False) -> bool:
    """Ask Linux to back the whole 2 MiB pages inside ``[address, address + nbytes)``
    with transparent huge pages: pages touched later fault in huge; with ``collapse``,
    pages already touched are gathered into huge ones now (Linux 6.1+; elsewhere the
    kernel's background collapser may do it later). Whether the advice was taken (False
    off Linux, for a region without a whole huge page, or where it was refused)."""
    first = (address + HUGE_PAGE_BYTES - 1) & ~(HUGE_PAGE_BYTES - 1)
    last = (address + nbytes) & ~(HUGE_PAGE_BYTES - 1)
    if platform.system() != "Linux" or last <= first:
        return False
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return False
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    if madvise(first, last - first, _MADV_HUGEPAGE) != 0:
        return False
    if collapse:
        madvise(first, last - first, _MADV_COLLAPSE)  # best effort: EINVAL before 6.1
    return True
