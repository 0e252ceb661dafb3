"""Compare the routing policies on a Mooncake trace replayed through a simulated fleet;
prints one JSON object with every policy's figures and the done-when checks.

Peers in the same run: ``round_robin``, ``least_loaded`` and ``consistent_hash``
against ``cache_aware`` (same trace, fleet model, index and router code as
``kvtoll bench routing --policy all``), plus the infinite-cache ceiling.

    python bench/routing_policies.py [--trace ../shared/data/mooncake_conversation_trace.jsonl]
        [--workers 4] [--cache-tokens 3072000] [--prefill-tokens-per-s 16000]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as ``python bench/<script>.py``: the repo root, for bench.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cli import run_routing_bench
from bench.routing.simulate import SimConfig
from bench.routing.trace import load_trace
from proxy.routing.policy import POLICY_NAMES

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[2] / "shared/data/mooncake_conversation_trace.jsonl"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--cache-tokens", type=int, default=3_072_000)
    parser.add_argument(
        "--prefill-tokens-per-s", type=float, default=SimConfig.prefill_tokens_per_s
    )
    args = parser.parse_args()
    config = SimConfig(
        num_workers=args.workers,
        cache_tokens=args.cache_tokens,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
    )
    results = run_routing_bench(load_trace(args.trace), config, list(POLICY_NAMES))
    ca, rr, ll = results["cache_aware"], results["round_robin"], results["least_loaded"]
    checks = {
        "cache_aware_hit_over_round_robin": round(ca["hit_rate"] / rr["hit_rate"], 3),
        "cache_aware_hit_of_ceiling": ca["hit_rate_of_ceiling"],
        "cache_aware_ttft_mean_over_least_loaded": round(ca["ttft_mean"] / ll["ttft_mean"], 3),
    }
    checks_pass = (
        checks["cache_aware_hit_over_round_robin"] >= 2.0
        and checks["cache_aware_hit_of_ceiling"] >= 0.75
        and checks["cache_aware_ttft_mean_over_least_loaded"] <= 1.0
    )
    print(
        json.dumps(
            {
                "config": vars(args) | {"trace": str(args.trace)},
                "policies": results,
                "checks": checks,
                "checks_pass": checks_pass,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
