"""A ``KVTOLL_*`` variable the settings refuse is one ``error:`` line and exit 2, for any
command that reads the settings, and nothing is written."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtoll.cli.main import run
from kvtoll.settings import Settings, SettingsError, load_settings

BAD = {
    "KVTOLL_RATE_LIMIT_BURST_S": "-1",
    "KVTOLL_KV_TIER_MB": "abc",
    "KVTOLL_DEV_MODE": "maybe",
    "KVTOLL_SEMANTIC_VERIFIER": "bm25",
    "KVTOLL_SEMANTIC_EXPLORE_RATE": "1.5",
    "KVTOLL_DB_CONNECT_TIMEOUT_S": "0",
}


@pytest.mark.parametrize(("name", "value"), sorted(BAD.items()))
@pytest.mark.parametrize("argv", [["tenant", "list"], ["db", "upgrade"]], ids=" ".join)
def test_bad_variable_is_one_error_line(
    name: str, value: str, argv: list[str], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    database = tmp_path / "kvtoll.db"
    monkeypatch.setenv("KVTOLL_DATABASE_URL", f"sqlite:///{database}")
    monkeypatch.setenv(name, value)
    assert run(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: invalid setting ")
    assert f"{name}={value}" in err and "Traceback" not in err
    assert not database.exists()  # refused before anything was written


def test_override_is_named_as_its_flag() -> None:
    with pytest.raises(SettingsError, match=r"--rate-limit-burst-s=-2: input should be greater"):
        load_settings(rate_limit_burst_s=-2)


def test_valid_settings_still_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTOLL_RATE_LIMIT_BURST_S", "2.5")
    settings = load_settings()
    assert isinstance(settings, Settings) and settings.rate_limit_burst_s == 2.5
