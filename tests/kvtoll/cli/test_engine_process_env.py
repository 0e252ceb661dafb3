"""The commands that run a CPU engine set their OpenMP wait policy (passive after a
short bounded spin) before their module (and torch) is imported, unless the environment
chose one (either variable); other commands do not."""

from __future__ import annotations

import os

import pytest

from kvtoll.cli.main import build_app


@pytest.mark.parametrize("command", ["worker", "serve"])
def test_engine_commands_default_to_passive_openmp_waits(
    monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    build_app([command, "--help"])
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    assert os.environ["GOMP_SPINCOUNT"] == "10000"


def test_a_chosen_policy_is_kept_and_other_commands_set_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    build_app(["worker", "--help"])
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    assert "GOMP_SPINCOUNT" not in os.environ  # ACTIVE's own spin stays unbounded
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setenv("GOMP_SPINCOUNT", "0")
    build_app(["serve", "--help"])
    assert "OMP_WAIT_POLICY" not in os.environ and os.environ["GOMP_SPINCOUNT"] == "0"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    build_app(["tenant", "--help"])
    assert "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ
