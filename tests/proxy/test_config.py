"""proxy.config.from_settings: the worker timeouts from KVTOLL_* variables."""

from __future__ import annotations

import pytest

from kvtoll.settings import SettingsError, load_settings
from proxy.config import from_settings


def test_worker_timeouts_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTOLL_WORKER_READ_TIMEOUT_S", "7")
    monkeypatch.setenv("KVTOLL_WORKER_RESPONSE_TIMEOUT_S", "1200")
    config = from_settings(load_settings())
    assert (config.upstream_first_byte_timeout_s, config.upstream_idle_timeout_s) == (7, 7)
    assert config.upstream_response_timeout_s == 1200


def test_whole_response_timeout_defaults_to_ten_minutes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVTOLL_WORKER_RESPONSE_TIMEOUT_S", raising=False)
    assert from_settings(load_settings()).upstream_response_timeout_s == 600


def test_a_whole_response_timeout_must_be_positive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTOLL_WORKER_RESPONSE_TIMEOUT_S", "0")
    with pytest.raises(SettingsError, match="KVTOLL_WORKER_RESPONSE_TIMEOUT_S"):
        load_settings()
