"""``GET /v1/invoices/preview`` and the dashboard's draft of the open month (SQLite and
PostgreSQL): the tenant's own usage of this month, marked draft, with no invoice id."""

from __future__ import annotations

import random
from dataclasses import replace
from datetime import UTC, datetime, timedelta

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from billing.invoice_export import exact_usd
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


def test_preview_is_the_callers_open_month_as_a_draft(
    web_factory: sessionmaker[Session], settings: Settings
) -> None:
    add_prices(web_factory)
    now = datetime.now(UTC)
    month = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    elapsed = max(1, int((now - month).total_seconds()) - 5)
    rng = random.Random(3)
    alpha, beta = add_tenant(web_factory, "alpha"), add_tenant(web_factory, "beta")
    this_month = [  # somewhere between the month's start and now
        replace(entry, created_at=month + timedelta(seconds=rng.randint(0, elapsed)))
        for entry in random_entries(rng, alpha, month, 1, 12)
    ]
    record(web_factory, alpha, this_month)
    record(web_factory, alpha, random_entries(rng, alpha, month - timedelta(days=40), 5, 7))
    record(web_factory, beta, random_entries(rng, beta, month, 1, 9))
    client = TestClient(create_web_app(settings, web_factory))
    headers = {"Authorization": f"Bearer {alpha.first_key}"}
    response = client.get("/v1/invoices/preview", headers=headers)
    assert response.status_code == 200, response.text
    assert response.headers["cache-control"] == "no-store"
    draft = response.json()
    assert (draft["status"], draft["id"], draft["tenant"]) == ("draft", None, "alpha")
    assert draft["period"] == f"{now:%Y-%m}"
    with web_factory() as session:
        billed, listed = ledger_money(session, alpha.tenant_id, month, month + timedelta(days=32))
    assert (draft["total_pico"], draft["list_pico"]) == (billed, listed)
    assert draft["total_usd"] == exact_usd(billed)
    assert sum(line["amount_pico"] for line in draft["lines"]) == billed
    assert client.get("/v1/invoices/preview").status_code == 401
    admin = client.get("/admin/v1/invoices/preview", params={"tenant": "alpha"},
                       headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert admin.status_code == 200 and admin.json()["total_pico"] == billed
    no_tenant = client.get("/admin/v1/invoices/preview",
                           headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert no_tenant.status_code == 400 and no_tenant.json()["error"]["param"] == "tenant"
    client.post("/dashboard/login", data={"api_key": alpha.first_key})
    page = client.get("/dashboard")
    assert page.status_code == 200 and 'id="invoice-preview"' in page.text
    assert f'id="preview-total">{exact_usd(billed)}<' in page.text
