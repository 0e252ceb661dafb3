"""Free the calling thread's OpenMP worker threads before another thread takes over the
compute.

With torch's OpenMP backend each thread that starts a parallel op becomes the master of
its own pool of worker threads, kept until that thread exits. GNU libgomp counts the
threads of every pool, and once they outnumber the CPUs it stops letting idle workers
spin before they sleep, so every op wakes them through the kernel. The engine loads
its model and runs its start-up probes on the thread that builds it, then steps on
its own thread (:mod:`engine.async_engine`): two pools on a 2-core machine. Measured
there (torch 2.13, libgomp, bf16 [64, 3,072]): an elementwise add 21 -> 64 us on the
second master, SiLU 57 -> 102 us, a 64-row gate/up projection 541 -> 595 us; the
64-request engine bench stepped from a new thread 328-330 tok/s against 344-357 on the
thread that loaded it. Freeing the first pool (``omp_pause_resource_all``, OpenMP 5.0)
before the step thread starts gives it back the full spin (22 / 59 us).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

from kvtoll.openmp_runtime import loaded_runtime

log = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free threads, keep the runtime's state


def release_thread_pool() -> bool:
    """Free the OpenMP worker threads that torch ops started from the calling thread
    made (a later op from it makes new ones); False where torch runs on no OpenMP
    runtime of its own found here, or the runtime refused (inside a parallel region)."""
    import torch

    if "OpenMP" not in torch.__config__.parallel_info():
        return False
    library = loaded_runtime(Path(torch.__file__).resolve().parent / "lib")
    if library is None:
        return False
    pause = getattr(ctypes.CDLL(library), "omp_pause_resource_all", None)
    if pause is None:  # a runtime older than OpenMP 5.0
        return False
    pause.argtypes = [ctypes.c_int]
    pause.restype = ctypes.c_int
    released = pause(OMP_PAUSE_SOFT) == 0
    log.debug("openmp: the calling thread's worker threads %s",
              "freed" if released else "kept (the runtime refused)")  # fmt: skip
    return released
