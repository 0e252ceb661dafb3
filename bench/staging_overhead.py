"""What running a step a layer at a time costs (engine.runner.StagedForward vs one
forward), on the real model: the same batch alternately through ``ModelRunner.execute``
and through ``ModelRunner.start`` + ``advance(1)`` per layer + ``logits``, ``--reps``
times each; the minimum of each side is the least disturbed reading on a shared CPU
(interference only adds time). Two batches: 16 decodes at context 272, and one
256-token prefill chunk. Prints one JSON object with the minima and medians (ms) and
their ratios (staged / whole).

    .venv/bin/python bench/staging_overhead.py --reps 30
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from engine.config import EngineConfig
from engine.factory import build_llm_engine
from engine.runner import ModelRunner, RunnerSeq


def _batches() -> dict[str, list[RunnerSeq]]:
    decodes = [RunnerSeq((100 + i,), 272, tuple(range(18 * i, 18 * i + 18)), True)
               for i in range(16)]  # fmt: skip
    prefill = [RunnerSeq(tuple(range(100, 356)), 0, tuple(range(16)), True)]
    return {"16_decodes": decodes, "prefill_256": prefill}


def _staged(runner: ModelRunner, batch: list[RunnerSeq]) -> None:
    forward = runner.start(batch)
    while forward.advance(1):
        pass
    forward.logits()


def measure(runner: ModelRunner, batch: list[RunnerSeq], reps: int) -> dict[str, Any]:
    whole: list[float] = []
    staged: list[float] = []
    for _ in range(reps):
        t = time.perf_counter()
        runner.execute(batch)
        whole.append(time.perf_counter() - t)
        t = time.perf_counter()
        _staged(runner, batch)
        staged.append(time.perf_counter() - t)
    return {
        "whole_min_ms": round(1000 * min(whole), 3),
        "staged_min_ms": round(1000 * min(staged), 3),
        "min_ratio": round(min(staged) / min(whole), 4),
        "whole_median_ms": round(1000 * statistics.median(whole), 3),
        "staged_median_ms": round(1000 * statistics.median(staged), 3),
        "median_ratio": round(statistics.median(staged) / statistics.median(whole), 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    config = EngineConfig(dtype=args.dtype, num_kv_blocks=400, max_num_batched_tokens=256,
                          max_model_len=4096)  # fmt: skip
    runner = build_llm_engine(config).runner
    out = {"dtype": config.dtype, "reps": args.reps}
    for name, batch in _batches().items():
        out[name] = measure(runner, batch, args.reps)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
