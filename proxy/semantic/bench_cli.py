"""``kvtoll bench semantic``: precision, recall and lookup latency on labelled pairs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from kvtoll.cli.errors import fail


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
) -> None:
    """Fill a fresh cache with every text_a, query every text_b, print one JSON object."""
    from proxy.semantic.evaluate import read_pairs, run_pair_bench_sync

    if not pairs.is_file():
        fail(f"--pairs: no such file: {pairs}")
    if threshold is not None and not 0.0 <= threshold <= 1.0:
        fail("--threshold must be between 0 and 1")
    if (limit is not None and limit < 1) or candidates < 1:
        fail("--limit and --candidates must be positive")
    try:
        rows = read_pairs(pairs)
    except (ValueError, UnicodeDecodeError) as exc:
        fail(str(exc))
    rows = rows[:limit] if limit else rows
    report = run_pair_bench_sync(
        rows, threshold=threshold, heldout_only=heldout_only, candidates=candidates
    )
    typer.echo(json.dumps(report))
