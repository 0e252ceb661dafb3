"""What tenant-fair scheduling costs one tenant's throughput (issue 26: <= 2% slower).

``bench/engine_throughput.py --fair-scheduling N`` runs the throughput workload ``2 x N``
times on one loaded model, OFF and ON interleaved (the order of each pair alternates,
so drift on a shared CPU favours neither side), each run stepping the engine as the
async engine's step thread does, with step hooks:

* OFF: ``EngineConfig(fair_scheduling=False)``: arrival order, every step one forward.
* ON: the default: the waiting queue ordered by tenant usage (one tenant: left as it
  is) and every step with a long prefill chunk run a layer at a time, the hooks polled
  between layers (nothing arrives: all requests are queued before the first step, so
  nothing interjects; what is measured is the staging and the checks).

Reported as bench.share_accounting reports: each run's output tokens/s, the medians,
ON / OFF of the medians and of each side's best run, the per-pair ratios.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from typing import Any

from engine.api import GenerationChunk, GenerationRequest, SamplingParams
from engine.config import EngineConfig
from engine.factory import LoadedModel, build_llm_engine


class _NoArrivals:
    """Step hooks of a closed workload: nothing arrives, nothing to deliver early."""

    def poll(self) -> bool:
        return False

    def deliver(self, chunks: list[GenerationChunk]) -> None:
        raise RuntimeError("nothing can interject without arrivals")


def _run(loaded: LoadedModel, config: EngineConfig, prompts: list[list[int]],
         max_tokens: list[int], on: bool) -> float:
    """Output tokens/s of one run, fair scheduling ON or OFF."""
    gc.collect()
    engine = build_llm_engine(dataclasses.replace(config, fair_scheduling=on), loaded)
    for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True)):
        params = SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
        engine.add_request(GenerationRequest(f"r{i}", tuple(p), params))
    hooks = _NoArrivals()
    produced = 0
    start = time.perf_counter()
    while engine.has_unfinished():
        produced += sum(c.completion_tokens for c in engine.step(hooks) if c.finish_reason)
    elapsed = time.perf_counter() - start
    if produced != sum(max_tokens):
        raise RuntimeError(f"engine produced {produced} tokens, expected {sum(max_tokens)}")
    return produced / elapsed


def fair_scheduling_cost(loaded: LoadedModel, config: EngineConfig, prompts: list[list[int]],
                         max_tokens: list[int], repeats: int) -> dict[str, Any]:
    """ON vs OFF, ``repeats`` interleaved pairs (see the module doc)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    off: list[float] = []
    on: list[float] = []
    for i in range(repeats):
        for side in ((False, True) if i % 2 == 0 else (True, False)):
            (on if side else off).append(_run(loaded, config, prompts, max_tokens, side))
    ratios = [a / b for a, b in zip(on, off, strict=True)]
    off_med, on_med = statistics.median(off), statistics.median(on)
    return {
        "pairs": repeats,
        "off_output_tokens_per_s": [round(v, 2) for v in off],
        "on_output_tokens_per_s": [round(v, 2) for v in on],
        "off_median": round(off_med, 2),
        "on_median": round(on_med, 2),
        "on_vs_off": round(on_med / off_med, 4),
        "on_vs_off_best": round(max(on) / max(off), 4),
        "pair_ratio_median": round(statistics.median(ratios), 4),
        "pair_ratio_min": round(min(ratios), 4),
        "pair_ratio_max": round(max(ratios), 4),
        "goal_on_vs_off_at_least": 0.98,
    }
