"""``kvtoll bench semantic`` on a handful of pairs, and its one-line input errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from bench.cli import semantic_command

PAIRS = [
    {"text_a": "How do I reset my password?", "text_b": "How can I reset my password?", "label": 1},
    {"text_a": "Who wrote Hamlet?", "text_b": "who wrote hamlet", "label": 1},
    {
        "text_a": "How do I enable dark mode on Windows?",
        "text_b": "How do I disable dark mode on Windows?",
        "label": 0,
    },
    {
        "text_a": "What is the capital of France?",
        "text_b": "How tall is Mount Everest?",
        "label": 0,
    },
]


def cli() -> typer.Typer:
    app = typer.Typer()
    app.command()(semantic_command)
    return app


def test_reports_precision_recall_and_stage_latencies(tmp_path: Path) -> None:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    result = CliRunner().invoke(cli(), ["--pairs", str(path)])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["hits"] == 2 and report["correct_hits"] == 2 and report["false_hits"] == 0
    assert report["precision"] == 1.0 and report["recall"] == 1.0 and report["hit_rate"] == 0.5
    for stage in ("embed", "search", "verify", "total"):
        assert set(report["latency_ms"][stage]) == {"p50", "p99"}
    assert report["peer_gptcache_similarity_0.8"]["hits"] >= 2
    views = report["precision_views"]["all"]
    assert views["strict"]["precision"] == 1.0 and views["own_pair"]["own_pair_hits"] == 2
    assert views["excluding_forced"]["queries"] == 4
    hard = report["hard_cases_heldout"]
    assert hard["total"]["total"] == sum(k["total"] for k in hard["per_kind"].values()) > 0


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"text_a": "a", "text_b": "b", "label": 2}\n', "label must be 0 or 1"),
        ("not json\n", "not JSON"),
        ('{"text_a": "", "text_b": "b", "label": 1}\n', "non-empty strings"),
        ("", "no pairs"),
    ],
)
def test_bad_pairs_file_is_a_one_line_error(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "pairs.jsonl"
    path.write_text(content)
    result = CliRunner().invoke(cli(), ["--pairs", str(path)])
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output


def test_missing_file_and_bad_threshold(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli(), ["--pairs", str(tmp_path / "nope.jsonl")])
    assert result.exit_code == 2 and "no such file" in result.output
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(PAIRS[0]) + "\n")
    result = CliRunner().invoke(cli(), ["--pairs", str(path), "--threshold", "1.5"])
    assert result.exit_code == 2


def test_both_readings_the_curve_and_the_plot(tmp_path: Path) -> None:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    png = tmp_path / "curve.png"
    result = CliRunner().invoke(cli(), ["--pairs", str(path), "--plot", str(png)])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    at = report["per_query"]["at_threshold"]
    assert at["hits"] == report["hits"] and at["false_hits"] == report["false_hits"]
    assert report["per_query"]["curve"] and report["peer_gptcache_similarity_0.8"]["curve"]
    pairwise = report["pairwise"]
    assert pairwise["pairs"] == 4 and 0.0 <= pairwise["average_precision"] <= 1.0
    assert 0.0 <= pairwise["roc_auc"] <= 1.0
    assert report["peer_gptcache_similarity_0.8"]["at_our_hit_rate"]["hits"] <= report["hits"]
    hard = report["hard_cases_heldout"]
    assert hard["near_misses"] + hard["paraphrases"] == hard["total"]["total"]
    assert hard["near_misses_served"] == len(hard["near_misses_served_list"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_verifier_and_plot_suffix_are_one_line_errors(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(PAIRS[0]) + "\n")
    result = CliRunner().invoke(cli(), ["--pairs", str(path), "--verifier", "magic"])
    assert result.exit_code == 2 and "--verifier" in result.output
    result = CliRunner().invoke(cli(), ["--pairs", str(path), "--plot", str(tmp_path / "x.gif")])
    assert result.exit_code == 2 and ".png" in result.output
