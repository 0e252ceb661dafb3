"""Timing two or more ways of doing the same work on this machine, for start-up races
(:mod:`engine.attention.cpu_probes`, :mod:`engine.model.native_linear`) and benchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable


def interleaved_best(fns: dict[str, Callable[[], object]], runs: int) -> dict[str, float]:
    """Best of ``runs`` seconds per function, after one warm-up call each; the functions
    take turns within every run, so a busy neighbour slows all of them alike."""
    if runs < 1:
        raise ValueError(f"runs must be positive, got {runs}")
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(runs):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best
