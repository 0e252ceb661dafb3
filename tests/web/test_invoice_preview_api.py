"""``GET /v1/invoices/preview`` and the dashboard's draft of the open month (SQLite and
PostgreSQL): the tenant's own usage of this month, marked draft, with no invoice id;
the dashboards' budget tables with this month's spend."""

from __future__ import annotations

import random
from dataclasses import replace
from datetime import UTC, datetime, timedelta

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from billing.budgets import set_budget
from billing.invoice_export import exact_usd
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
from web.pages import format_usd_html


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
    assert str(format_usd_html(exact_usd(billed))) in page.text  # to the cent, exact on hover
    assert f'id="preview-total"><span class="usd" title="{exact_usd(billed)} USD"' in page.text


def test_dashboards_show_budgets_with_this_months_spend(
    web_factory: sessionmaker[Session], settings: Settings
) -> None:
    add_prices(web_factory)
    alpha = add_tenant(web_factory, "alpha", num_keys=1)
    now = datetime.now(UTC)
    month = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    entries = [replace(e, created_at=month) for e in random_entries(random.Random(5), alpha,
                                                                     month, 1, 6)]
    record(web_factory, alpha, entries)
    with web_factory() as session:
        billed, _ = ledger_money(session, alpha.tenant_id, month, month + timedelta(days=32))
    key_id = next(iter(alpha.keys))
    with web_factory.begin() as session:  # the tenant's budget is spent; its key's is not
        set_budget(session, "alpha", None, pico_to_usd(billed), "0.5")
        set_budget(session, "alpha", key_id, pico_to_usd(billed * 4), "1")
    client = TestClient(create_web_app(settings, web_factory))
    client.post("/dashboard/login", data={"api_key": alpha.first_key})
    page = client.get("/dashboard").text
    assert page.count('data-state="exceeded"') == 1 and page.count('data-state="ok"') == 1
    assert f"<td>{format_usd_html(exact_usd(billed))}</td>" in page and "alpha-key-0" in page
    assert ">100%<" in page and ">25%<" in page and ">50%<" in page
    client.post("/admin/dashboard/login", data={"admin_token": ADMIN_TOKEN})
    admin = client.get("/admin/dashboard").text
    assert 'id="budget-status"' in admin and admin.count('data-state="exceeded"') == 1
