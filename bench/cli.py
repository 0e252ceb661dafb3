"""``kvtoll bench``: the benchmark command group (each command prints JSON figures).

    kvtoll bench semantic --pairs FILE ...   precision, recall and lookup latency on pairs
    kvtoll bench semantic --stream --pairs FILE --max-error-rate D [--plot P]
                                             the error bound on a shuffled prompt stream
    kvtoll bench routing --trace FILE ...    a Mooncake trace through a simulated fleet

The root CLI (:mod:`kvtoll.cli.main`) adds :data:`app` as ``bench`` when it is built;
the heavy modules (embedder, FAISS) load only when ``semantic`` runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from bench.routing.simulate import SimConfig, simulate
from bench.routing.trace import TraceRequest, infinite_cache_hit_rate, load_trace
from kvtoll.cli.errors import fail
from proxy.routing.policy import POLICY_NAMES, make_policy

MAX_CANDIDATES = 1024
app = typer.Typer(help="Benchmarks (print JSON figures).", no_args_is_help=True)


@app.command("semantic")
def semantic_command(
    pairs: Annotated[Path, typer.Option("--pairs", help="JSONL rows {text_a, text_b, label}")],
    threshold: Annotated[
        float | None, typer.Option(help="verifier threshold (default: the shipped one)")
    ] = None,
    limit: Annotated[int | None, typer.Option(help="use only the first N pairs")] = None,
    heldout_only: Annotated[
        bool, typer.Option("--heldout-only", help="query only the QQP pairs held out of training")
    ] = False,
    candidates: Annotated[int, typer.Option(help="nearest entries the verifier scores")] = 4,
    stream: Annotated[
        bool, typer.Option("--stream", help="replay the pairs as a shuffled prompt stream")
    ] = False,
    max_error_rate: Annotated[
        float, typer.Option("--max-error-rate", help="--stream: the error bound, in (0, 1)")
    ] = 0.02,
    explore_rate: Annotated[
        float, typer.Option("--explore-rate", help="--stream: share of would-be hits explored")
    ] = 0.1,
    repeat_rate: Annotated[
        float, typer.Option("--repeat-rate", help="--stream: P(exact repeat after a prompt)")
    ] = 0.25,
    seed: Annotated[int, typer.Option("--seed", help="--stream: shuffle and exploration seed")] = 0,
    verifier: Annotated[
        str | None, typer.Option(help="pair-encoder, cross-encoder or logistic")
    ] = None,
    plot: Annotated[
        Path | None,
        typer.Option("--plot", help="PNG: precision/hit-rate beside cosine (--stream: over time)"),
    ] = None,
    vectors_cache: Annotated[
        Path | None,
        typer.Option("--vectors-cache", help="folder keeping the embeddings between runs"),
    ] = None,
) -> None:
    """Fill a fresh cache with every text_a, query every text_b, print one JSON object
    (``--stream``: the error bound against the fixed threshold on a prompt stream)."""
    from bench.semantic.evaluate import read_pairs, run_pair_bench_sync
    from proxy.semantic.factory import VERIFIER_CHOICES, default_verifier

    if not pairs.is_file():
        fail(f"--pairs: no such file: {pairs}")
    if stream:
        _stream_command(pairs, limit, max_error_rate, explore_rate, repeat_rate, seed, plot,
                        verifier, heldout_only)  # fmt: skip
        return
    if threshold is not None and not 0.0 <= threshold <= 1.0:
        fail("--threshold must be between 0 and 1")
    if (limit is not None and limit < 1) or not 1 <= candidates <= MAX_CANDIDATES:
        fail(f"--limit must be positive and --candidates between 1 and {MAX_CANDIDATES}")
    verifier = verifier or default_verifier()
    if verifier not in VERIFIER_CHOICES:
        fail(f"--verifier must be one of {', '.join(VERIFIER_CHOICES)}")
    if plot is not None and plot.suffix.lower() != ".png":
        fail("--plot must name a .png file")
    try:
        rows = read_pairs(pairs)
    except (ValueError, UnicodeDecodeError) as exc:
        fail(str(exc))
    rows = rows[:limit] if limit else rows
    report = run_pair_bench_sync(
        rows, threshold=threshold, heldout_only=heldout_only, candidates=candidates,
        verifier=verifier, plot=plot, vectors_cache=vectors_cache,
    )
    typer.echo(json.dumps(report))


def _stream_command(pairs: Path, limit: int | None, max_error_rate: float, explore_rate: float,
                    repeat_rate: float, seed: int, plot: Path | None, verifier: str | None,
                    heldout_only: bool) -> None:  # fmt: skip
    from bench.semantic.evaluate import qqp_split, read_pairs
    from bench.semantic.stream import StreamConfig, plot_stream, run_stream_bench_sync
    from proxy.semantic.factory import VERIFIER_CHOICES

    if not 0.0 < max_error_rate < 1.0:
        fail(f"--max-error-rate must be in (0, 1), got {max_error_rate}")
    if not 0.0 <= explore_rate <= 1.0 or not 0.0 <= repeat_rate < 1.0:
        fail("--explore-rate must be in [0, 1] and --repeat-rate in [0, 1)")
    if (limit is not None and limit < 1) or seed < 0:
        fail("--limit must be positive and --seed >= 0")
    if plot is not None and not plot.parent.is_dir():
        fail(f"--plot: no such directory: {plot.parent}")
    if verifier is not None and verifier not in VERIFIER_CHOICES:
        fail(f"--verifier must be one of {', '.join(VERIFIER_CHOICES)}")
    try:
        rows = read_pairs(pairs)
    except (ValueError, UnicodeDecodeError) as exc:
        fail(str(exc))
    if heldout_only:  # the pairs no verifier was fitted or calibrated on
        rows = [r for r in rows if qqp_split(r.text_a, r.text_b) == "heldout"]
    config = StreamConfig(max_error_rate, explore_rate, repeat_rate, seed, verifier=verifier)
    report = run_stream_bench_sync(rows[:limit] if limit else rows, config)
    if plot is not None:
        plot_stream(report, plot)
        report["plot"] = str(plot)
    typer.echo(json.dumps(report))


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


@app.command("routing")
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


def register(root: typer.Typer) -> None:
    """Add ``kvtoll bench`` to the root CLI (:mod:`kvtoll.cli.main` loads this on use)."""
    root.add_typer(app, name="bench")
