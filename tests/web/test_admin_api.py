"""Operator APIs across tenants, with the tenant filter (SQLite and PostgreSQL)."""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime
from decimal import Decimal

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from billing.invoices import close_period, parse_period
from billing.models import Tenant
from billing.money import pico_to_usd
from kvtoll.settings import Settings
from tests.web.webseed import (
    ADMIN_TOKEN,
    add_prices,
    add_tenant,
    ledger_money,
    random_entries,
    record,
)
from web.app import create_web_app

JAN = datetime(2026, 1, 1, tzinfo=UTC)
FEB = datetime(2026, 2, 1, tzinfo=UTC)
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
WINDOW = {"start_time": int(JAN.timestamp()), "end_time": int(FEB.timestamp()), "limit": 31}


def _results(page: dict) -> list[dict]:
    return [r for b in page["data"] for r in b["results"]]


def test_admin_usage_groups_by_tenant_and_filters(
    web_factory: sessionmaker[Session], settings: Settings
) -> None:
    add_prices(web_factory)
    rng = random.Random(3)
    seeds = [add_tenant(web_factory, name, num_keys=1) for name in ("alpha", "beta", "gamma")]
    for seed, count in zip(seeds, (30, 20, 10), strict=True):
        record(web_factory, seed, random_entries(rng, seed, JAN, 31, count))
    workers = [{"worker": "w0", "healthy": True}]
    client = TestClient(create_web_app(settings, web_factory, worker_status=lambda: workers))
    url = "/admin/v1/organization/usage/completions"
    grouped = client.get(url, params={**WINDOW, "group_by": "tenant"}, headers=ADMIN).json()
    per_tenant: dict[str, int] = {}
    for r in _results(grouped):
        per_tenant[r["tenant"]] = per_tenant.get(r["tenant"], 0) + r["num_model_requests"]
    assert per_tenant == {"alpha": 30, "beta": 20, "gamma": 10}
    only = client.get(url, params={**WINDOW, "tenant": "beta"}, headers=ADMIN).json()
    assert sum(r["num_model_requests"] for r in _results(only)) == 20
    assert sum(r["input_tokens"] for r in _results(only)) == sum(
        e.prompt_tokens for e in seeds[1].entries
    )
    unknown = client.get(url, params={**WINDOW, "tenant": "nobody"}, headers=ADMIN)
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "tenant"
    costs = client.get("/admin/v1/organization/costs", params={**WINDOW, "tenant": "alpha"},
                       headers=ADMIN)
    page = json.loads(costs.text, parse_float=Decimal)
    with web_factory() as session:
        billed, _ = ledger_money(session, seeds[0].tenant_id, JAN, FEB)
    assert sum(Decimal(r["amount"]["value"]) for r in _results(page)) == pico_to_usd(billed)
    assert "w0" in client.get("/admin/dashboard", headers=ADMIN).text


@pytest.mark.parametrize("fmt", ["pdf", "csv", "json"])
def test_admin_lists_and_downloads_every_tenants_invoices(
    sqlite_web_factory: sessionmaker[Session], settings: Settings, fmt: str
) -> None:
    factory = sqlite_web_factory
    add_prices(factory)
    rng = random.Random(5)
    ids = []
    for name in ("alpha", "beta"):
        seed = add_tenant(factory, name, num_keys=1)
        record(factory, seed, random_entries(rng, seed, JAN, 31, 5))
        with factory.begin() as session:
            tenant = session.get(Tenant, seed.tenant_id)
            assert tenant is not None
            ids.append(close_period(session, tenant, parse_period("2026-01")).id)
    client = TestClient(create_web_app(settings, factory))
    listed = client.get("/admin/v1/invoices", headers=ADMIN).json()["data"]
    assert sorted((i["id"], i["tenant"]) for i in listed) == [(ids[0], "alpha"), (ids[1], "beta")]
    only = client.get("/admin/v1/invoices", params={"tenant": "beta"}, headers=ADMIN).json()
    assert [i["id"] for i in only["data"]] == [ids[1]]
    for invoice_id in ids:
        response = client.get(f"/admin/v1/invoices/{invoice_id}/download",
                              params={"format": fmt}, headers=ADMIN)
        assert response.status_code == 200
        assert response.headers["content-type"].startswith(
            {"pdf": "application/pdf", "csv": "text/csv", "json": "application/json"}[fmt]
        )
        assert f"kvtoll-invoice-{invoice_id}-2026-01.{fmt}" in response.headers[
            "content-disposition"
        ]
    missing = client.get("/admin/v1/invoices/999/download", headers=ADMIN)
    assert missing.status_code == 404
