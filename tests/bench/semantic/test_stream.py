"""``kvtoll bench semantic --stream``: the stream, the oracle, a small real run, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from bench.cli import semantic_command
from bench.semantic.evaluate import Pair
from bench.semantic.stream import Oracle, build_stream

PAIRS = [
    Pair("How do I reset my password?", "How can I reset my password?", 1),
    Pair("Who wrote Hamlet?", "Who is the author of Hamlet?", 1),
    Pair("How do I enable dark mode on Windows?", "How do I disable dark mode on Windows?", 0),
    Pair("What is the capital of France?", "How tall is Mount Everest?", 0),
]


def cli() -> typer.Typer:
    app = typer.Typer()
    app.command()(semantic_command)
    return app


def test_stream_holds_every_text_and_repeats_only_earlier_prompts() -> None:
    stream = build_stream(PAIRS, repeat_rate=0.5, seed=3)
    assert stream == build_stream(PAIRS, repeat_rate=0.5, seed=3)  # seeded
    assert stream != build_stream(PAIRS, repeat_rate=0.5, seed=4)
    texts = {t for p in PAIRS for t in (p.text_a, p.text_b)}
    assert set(stream) == texts and len(stream) > len(texts)
    assert build_stream(PAIRS, repeat_rate=0.0, seed=3).__len__() == len(texts)


def test_oracle_is_the_label() -> None:
    oracle = Oracle(PAIRS)
    assert oracle.correct("Who wrote Hamlet?", "Who is the author of Hamlet?")
    assert oracle.correct("Who is the author of Hamlet?", "Who wrote Hamlet?")
    assert oracle.correct("How tall is Mount Everest?", "How tall is Mount Everest?")  # repeat
    assert not oracle.correct("How do I disable dark mode on Windows?",
                              "How do I enable dark mode on Windows?")  # fmt: skip
    assert not oracle.correct("Who wrote Hamlet?", "How can I reset my password?")


def test_small_stream_through_both_caches(tmp_path: Path) -> None:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(vars(p)) + "\n" for p in PAIRS))
    plot = tmp_path / "stream.png"
    result = CliRunner().invoke(cli(), ["--pairs", str(path), "--stream", "--repeat-rate", "0.5",
                                        "--seed", "1", "--plot", str(plot)])  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["queries"] == len(build_stream(PAIRS, 0.5, 1))
    repeats = report["oracle_repeats"]
    assert repeats == report["queries"] - 8 and report["oracle_hits"] >= repeats
    bounded, fixed = report["bounded"], report["fixed_threshold"]
    # No evidence yet: the bound serves exact repeats and nothing else, all of them.
    assert bounded["hits"] == bounded["oracle_hits_served"] == repeats
    assert bounded["wrong_hits"] == 0 and bounded["share_of_oracle_repeats_served"] == 1.0
    assert fixed["hits"] >= repeats and fixed["curve"][-1]["queries"] == report["queries"]
    assert plot.stat().st_size > 0 and report["plot"] == str(plot)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-error-rate", "0"], "--max-error-rate must be in (0, 1)"),
        (["--max-error-rate", "1"], "--max-error-rate must be in (0, 1)"),
        (["--explore-rate", "1.5"], "--explore-rate"),
        (["--repeat-rate", "1"], "--repeat-rate"),
        (["--limit", "0"], "--limit must be positive"),
        (["--seed", "-3"], "--seed >= 0"),
        (["--plot", "/no/such/dir/x.png"], "--plot: no such directory"),
    ],
)
def test_bad_stream_options_are_one_line_errors(
    tmp_path: Path, args: list[str], message: str
) -> None:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(vars(p)) + "\n" for p in PAIRS))
    result = CliRunner().invoke(cli(), ["--pairs", str(path), "--stream", *args])
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: ")
    assert message in result.stderr
