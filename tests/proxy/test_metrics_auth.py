"""``/metrics`` names tenants and their rates: outside dev mode it needs the metrics
token (``KVTOLL_METRICS_TOKEN``) or the admin token; in dev mode it is open unless a
metrics token is set. A refusal is a 401 in OpenAI's shape with one WARNING line."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr
from sqlalchemy.orm import Session, sessionmaker

from kvtoll.settings import Settings
from tests.proxy.helpers import ADMIN, ADMIN_TOKEN, build_app
from tests.proxy.scripted import ScriptedUpstream

METRICS_TOKEN = "metrics-token-for-the-scraper-0123"


def _client(settings: Settings, db: sessionmaker[Session], **update: object) -> TestClient:
    changed = settings.model_copy(update=update)
    return TestClient(build_app(changed, db, upstreams=[ScriptedUpstream()]))


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_metrics_need_the_metrics_or_the_admin_token(
    settings: Settings, db: sessionmaker[Session], caplog: pytest.LogCaptureFixture
) -> None:
    client = _client(settings, db, metrics_token=SecretStr(METRICS_TOKEN))
    for headers in ({}, _bearer("nope"), _bearer(METRICS_TOKEN[:-1]), {"Authorization": "x"}):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="proxy.routes.ops"):
            response = client.get("/metrics", headers=headers)
        assert response.status_code == 401
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        assert "kvtoll_" not in response.text
        assert [r.levelname for r in caplog.records] == ["WARNING"]
    for headers in (_bearer(METRICS_TOKEN), ADMIN):
        response = client.get("/metrics", headers=headers)
        assert response.status_code == 200 and "kvtoll_outbox_depth" in response.text


def test_without_a_metrics_token_the_admin_token_still_works(
    settings: Settings, db: sessionmaker[Session]
) -> None:
    client = _client(settings, db)
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers=_bearer("")).status_code == 401
    assert client.get("/metrics", headers=_bearer(ADMIN_TOKEN)).status_code == 200


def test_dev_mode_opens_metrics_unless_a_metrics_token_is_set(
    settings: Settings, db: sessionmaker[Session], tmp_path: Path
) -> None:
    dev = {"dev_mode": True, "data_dir": str(tmp_path)}
    assert _client(settings, db, **dev).get("/metrics").status_code == 200
    guarded = _client(settings, db, **dev,
                      metrics_token=SecretStr(METRICS_TOKEN))
    assert guarded.get("/metrics").status_code == 401
    assert guarded.get("/metrics", headers=_bearer(METRICS_TOKEN)).status_code == 200
