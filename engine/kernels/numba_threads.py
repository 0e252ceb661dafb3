"""numba's parallel launches from the engine's threads: which back ends allow them, and
the thread count and chunk size around each launch (the numba decode kernels, the CPU
backend's fallback where the native kernels, which run on torch's OpenMP threads, do
not build)."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager

import numba
import torch

# Decode rows handed to a thread at a time: contexts of 32 and 2,048 tokens differ 64x
# in work, so rows are handed out one by one rather than in static halves.
CHUNK_SIZE = 1

# numba's parallel back ends that allow launches from several threads at once (engines
# run in their own threads); its fallback, "workqueue", aborts the process on that.
THREADSAFE_LAYERS = {"tbb": "numba.np.ufunc.tbbpool", "omp": "numba.np.ufunc.omppool"}


def threadsafe_parallelism_available() -> bool:
    """Whether numba can load a thread-safe parallel back end (libtbb or libgomp) here."""
    for module in THREADSAFE_LAYERS.values():
        try:
            importlib.import_module(module)
        except ImportError:
            continue
        return True
    return False


@contextmanager
def numba_launch(num_threads: int | None) -> Iterator[None]:
    """Around a launch of parallel kernels: numba's threads set to ``num_threads``
    (default torch's intra-op threads, so one setting governs both) and rows handed out
    :data:`CHUNK_SIZE` at a time, the chunk size restored after. Both settings are per
    calling thread in numba."""
    most = numba.config.NUMBA_NUM_THREADS  # type: ignore[attr-defined]
    threads = min(num_threads or torch.get_num_threads(), most)
    if numba.get_num_threads() != threads:
        numba.set_num_threads(threads)
    previous = numba.set_parallel_chunksize(CHUNK_SIZE)
    try:
        yield
    finally:
        numba.set_parallel_chunksize(previous)
