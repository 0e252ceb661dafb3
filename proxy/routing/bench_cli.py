"""``kvtoll bench routing``: replay a Mooncake trace through a simulated fleet.

:func:`routing_command` is a plain function with typer-annotated parameters; the
bench command group (``proxy/cli/bench.py``) registers it as ``routing``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from kvtoll.cli.errors import fail
from proxy.routing.policy import POLICY_NAMES, make_policy
from proxy.routing.simulate import SimConfig, simulate
from proxy.routing.trace import TraceRequest, infinite_cache_hit_rate, load_trace


def run_routing_bench(
    requests: list[TraceRequest], config: SimConfig, policies: list[str]
) -> dict[str, dict[str, Any]]:
    """Figures per policy, each with the trace's infinite-cache ceiling beside it."""
    ceiling = infinite_cache_hit_rate(requests, config.block_size)
    results: dict[str, dict[str, Any]] = {}
    for name in policies:
        figures = simulate(requests, config, make_policy(name)).to_dict()
        figures["infinite_cache_hit_rate"] = round(ceiling, 4)
        figures["hit_rate_of_ceiling"] = round(figures["hit_rate"] / ceiling, 4) if ceiling else 0.0
        results[name] = figures
    return results


def routing_command(
    trace: Annotated[Path, typer.Option("--trace", help="Mooncake-format JSONL trace")],
    workers: Annotated[int, typer.Option("--workers", help="simulated workers")] = 4,
    cache_tokens: Annotated[
        int, typer.Option("--cache-tokens", help="KV cache per worker, in tokens")
    ] = 3_072_000,
    policy: Annotated[
        str, typer.Option("--policy", help=f"one of {', '.join(POLICY_NAMES)}, or 'all'")
    ] = "cache_aware",
    block_size: Annotated[int, typer.Option("--block-size", help="tokens per hash id")] = 512,
    prefill_tokens_per_s: Annotated[
        float, typer.Option("--prefill-tokens-per-s", help="per-worker prefill speed")
    ] = SimConfig.prefill_tokens_per_s,
    limit: Annotated[
        int | None, typer.Option("--limit", help="replay only the first N requests")
    ] = None,
    index: Annotated[
        str, typer.Option("--index", help="precise (KV events) or approx (no events)")
    ] = "precise",
) -> None:
    """Replay a trace under one routing policy (or all) and print the figures as JSON."""
    policies = list(POLICY_NAMES) if policy == "all" else [policy]
    if policy != "all" and policy not in POLICY_NAMES:
        fail(f"unknown policy {policy!r}; expected one of {', '.join(POLICY_NAMES)} or all")
    if index not in ("precise", "approx"):
        fail(f"--index must be precise or approx, got {index!r}")
    try:
        config = SimConfig(
            num_workers=workers,
            cache_tokens=cache_tokens,
            block_size=block_size,
            prefill_tokens_per_s=prefill_tokens_per_s,
            kv_events=index == "precise",
        )
    except ValueError as exc:
        fail(str(exc))
    results = run_routing_bench(_read_trace(trace, limit), config, policies)
    typer.echo(json.dumps(results if policy == "all" else results[policy]))


def _read_trace(trace: Path, limit: int | None) -> list[TraceRequest]:
    """The trace's requests, or a one-line error (exit 2) for a caller's mistake."""
    if limit is not None and limit <= 0:
        fail("--limit must be positive")
    if not trace.is_file():
        fail(f"trace file not found: {trace}")
    try:
        requests = load_trace(trace, limit)
    except (ValueError, UnicodeDecodeError) as exc:
        fail(str(exc))
    if not requests:
        fail(f"trace file has no requests: {trace}")
    return requests
