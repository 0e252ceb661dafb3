"""The commands that run a CPU engine set their OpenMP wait policy before their module
(and torch) is imported, unless the environment chose one; other commands do not."""

from __future__ import annotations

import os

import pytest

from kvtoll.cli.main import build_app


@pytest.mark.parametrize("command", ["worker", "serve"])
def test_engine_commands_default_to_passive_openmp_waits(
    monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    build_app([command, "--help"])
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"


def test_a_chosen_policy_is_kept_and_other_commands_set_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    build_app(["worker", "--help"])
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    build_app(["tenant", "--help"])
    assert "OMP_WAIT_POLICY" not in os.environ
