"""Limit torch's intra-op threads for the calling thread only.

``torch.set_num_threads`` is process-wide: it would also slow an in-process engine
down. With torch's OpenMP backend, the number of threads an op started from a thread
uses is that thread's OpenMP setting (``omp_get_max_threads``), which
``omp_set_num_threads`` changes for the calling thread alone. torch sets it once per
thread, from its process-wide value, the first time the thread asks for it; so this
module makes torch do that first and then overrides it.

Why the semantic cache wants it: the MiniLM embedder on one intra-op thread spends
2.5-2.9 ms of CPU per text (batches of 8-16), on two threads 4.6-5.1 ms (measured on
this project's 2-core CI machine), so two workers of one thread each embed 1.2-1.7x
as many texts per second as one worker of two threads.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

from kvtoll.openmp_runtime import loaded_runtime

log = logging.getLogger(__name__)


def _torch_openmp_library() -> str | None:
    """Path of the OpenMP runtime loaded from torch's own ``lib`` directory, if any."""
    import torch

    if "OpenMP" not in torch.__config__.parallel_info():
        return None
    return loaded_runtime(Path(torch.__file__).resolve().parent / "lib")


def limit_this_thread(num_threads: int) -> bool:
    """Make torch ops started from the calling thread use at most ``num_threads``
    threads; False (nothing changed) where torch does not run on a known OpenMP
    runtime of its own (other builds, other platforms)."""
    if num_threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    import torch

    library = _torch_openmp_library()
    if library is None:
        log.info("torch's OpenMP runtime not found: embedder threads keep torch's setting")
        return False
    torch.get_num_threads()  # torch's once-per-thread initialisation happens here, first
    ctypes.CDLL(library).omp_set_num_threads(ctypes.c_int(num_threads))
    return torch.get_num_threads() == num_threads
