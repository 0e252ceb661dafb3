"""interleaved_best: a warm-up call each, then the functions take turns, best kept."""

from __future__ import annotations

import time

import pytest

from engine.timing import interleaved_best


def test_every_function_warms_up_then_takes_turns() -> None:
    calls: list[str] = []

    def slow() -> None:
        calls.append("slow")
        time.sleep(0.002)

    best = interleaved_best({"fast": lambda: calls.append("fast"), "slow": slow}, runs=3)
    assert calls == ["fast", "slow"] * 4
    assert set(best) == {"fast", "slow"}
    assert 0 <= best["fast"] < 0.002 <= best["slow"]


def test_runs_must_be_positive() -> None:
    with pytest.raises(ValueError, match="runs must be positive"):
        interleaved_best({"x": lambda: None}, runs=0)
