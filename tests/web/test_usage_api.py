"""Usage, costs and invoice APIs against a real database (SQLite and PostgreSQL)."""

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
    add_prices,
    add_tenant,
    ledger_money,
    random_entries,
    record,
    sent_totals,
)
from web.app import create_web_app

JAN = datetime(2026, 1, 1, tzinfo=UTC)
FEB = datetime(2026, 2, 1, tzinfo=UTC)


@pytest.fixture
def world(web_factory: sessionmaker[Session], settings: Settings) -> dict:
    add_prices(web_factory)
    rng = random.Random(7)
    alpha, beta = add_tenant(web_factory, "alpha"), add_tenant(web_factory, "beta")
    record(web_factory, alpha, random_entries(rng, alpha, JAN, 31, 60))
    record(web_factory, beta, random_entries(rng, beta, JAN, 31, 40))
    client = TestClient(create_web_app(settings, web_factory))
    return {"alpha": alpha, "beta": beta, "client": client, "factory": web_factory}


def _get(client: TestClient, path: str, key: str, **params: object) -> dict:
    response = client.get(path, params=params, headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    return response.json()


def _sum(page: dict, field: str) -> int:
    return sum(r[field] for b in page["data"] for r in b["results"])


def test_usage_equals_what_the_tenant_sent(world: dict) -> None:
    alpha = world["alpha"]
    page = _get(
        world["client"], "/v1/organization/usage/completions", alpha.first_key,
        start_time=int(JAN.timestamp()), end_time=int(FEB.timestamp()), bucket_width="1d", limit=31,
    )
    assert page["object"] == "page" and len(page["data"]) == 31 and page["has_more"] is False
    sent = sent_totals(alpha.entries, JAN, FEB)
    assert _sum(page, "num_model_requests") == sent["requests"] == 60
    assert _sum(page, "input_tokens") == sent["input_tokens"]
    assert _sum(page, "input_cached_tokens") == sent["cached_tokens"]
    assert _sum(page, "output_tokens") == sent["output_tokens"]
    assert _sum(page, "semantic_hit_requests") == sent["semantic_requests"]
    assert _sum(page, "semantic_hit_tokens") == sent["semantic_tokens"]
    for bucket in page["data"]:
        day = datetime.fromtimestamp(bucket["start_time"], UTC)
        later = datetime.fromtimestamp(bucket["end_time"], UTC)
        assert _sum({"data": [bucket]}, "num_model_requests") == sent_totals(
            alpha.entries, day, later
        )["requests"]


def test_group_by_model_and_key_partitions_the_totals(world: dict) -> None:
    alpha = world["alpha"]
    page = _get(
        world["client"], "/v1/organization/usage/completions", alpha.first_key,
        start_time=int(JAN.timestamp()), end_time=int(FEB.timestamp()), limit=31,
        group_by="model,api_key",
    )
    results = [r for b in page["data"] for r in b["results"]]
    assert {r["api_key_id"] for r in results} <= set(alpha.keys)
    for key_id in alpha.keys:
        mine = [e for e in alpha.entries if e.api_key_id == key_id]
        assert sum(r["num_model_requests"] for r in results if r["api_key_id"] == key_id) == len(
            mine
        )


def test_hourly_buckets_paginate_with_a_cursor(world: dict) -> None:
    alpha, client = world["alpha"], world["client"]
    params = {"start_time": int(JAN.timestamp()), "end_time": int(FEB.timestamp()),
              "bucket_width": "1h", "limit": 168}
    total, pages = 0, 0
    while True:
        page = _get(client, "/v1/organization/usage/completions", alpha.first_key, **params)
        total += _sum(page, "num_model_requests")
        pages += 1
        if not page["has_more"]:
            break
        params["page"] = page["next_page"]
    assert pages == 5  # 744 hours in 168-hour pages
    assert total == len(alpha.entries)


def test_costs_equal_the_ledger_exactly(world: dict) -> None:
    alpha, factory = world["alpha"], world["factory"]
    response = world["client"].get(
        "/v1/organization/costs",
        params={"start_time": int(JAN.timestamp()), "end_time": int(FEB.timestamp()), "limit": 31},
        headers={"Authorization": f"Bearer {alpha.first_key}"},
    )
    page = json.loads(response.text, parse_float=Decimal)
    billed = sum(Decimal(r["amount"]["value"]) for b in page["data"] for r in b["results"])
    listed = sum(Decimal(r["list_amount"]["value"]) for b in page["data"] for r in b["results"])
    with factory() as session:
        ledger_billed, ledger_list = ledger_money(session, alpha.tenant_id, JAN, FEB)
    assert billed == pico_to_usd(ledger_billed) and listed == pico_to_usd(ledger_list)
    assert ledger_billed < ledger_list  # caching saved something


def test_tenants_never_see_each_other(world: dict) -> None:
    alpha, beta, client, factory = world["alpha"], world["beta"], world["client"], world["factory"]
    with factory.begin() as session:
        tenant = session.get(Tenant, beta.tenant_id)
        assert tenant is not None
        beta_invoice = close_period(session, tenant, parse_period("2026-01")).id
    page = _get(client, "/v1/organization/usage/completions", alpha.first_key,
                start_time=int(JAN.timestamp()), end_time=int(FEB.timestamp()), limit=31,
                group_by="api_key")
    seen_keys = {r["api_key_id"] for b in page["data"] for r in b["results"]}
    assert seen_keys and not seen_keys & set(beta.keys)
    assert _get(client, "/v1/invoices", alpha.first_key)["data"] == []
    assert [i["id"] for i in _get(client, "/v1/invoices", beta.first_key)["data"]] == [beta_invoice]
    for fmt in ("pdf", "csv", "json"):
        response = client.get(
            f"/v1/invoices/{beta_invoice}/download", params={"format": fmt},
            headers={"Authorization": f"Bearer {alpha.first_key}"},
        )
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "not_found"
    assert client.get(f"/v1/invoices/{beta_invoice}",
                      headers={"Authorization": f"Bearer {alpha.first_key}"}).status_code == 404
    detail = _get(client, f"/v1/invoices/{beta_invoice}", beta.first_key)
    with factory() as session:
        billed, _ = ledger_money(session, beta.tenant_id, JAN, FEB)
    assert detail["total_pico"] == billed == sum(line["amount_pico"] for line in detail["lines"])
    for bogus in ("abc", "99999999999999999999", "-1", "²"):
        response = client.get(f"/v1/invoices/{bogus}",
                              headers={"Authorization": f"Bearer {beta.first_key}"})
        assert response.status_code == 404
    own = client.get(f"/v1/invoices/{beta_invoice}/download", params={"format": "csv"},
                     headers={"Authorization": f"Bearer {beta.first_key}"})
    assert own.status_code == 200 and "beta" in own.text


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({}, "start_time"),
        ({"start_time": "yesterday"}, "start_time"),
        ({"start_time": "253402300799"}, "start_time"),
        ({"start_time": "²"}, "start_time"),
        ({"start_time": "100", "limit": "٣"}, "limit"),
        ({"start_time": "100", "end_time": "50"}, "end_time"),
        ({"start_time": "100", "bucket_width": "1w"}, "bucket_width"),
        ({"start_time": "100", "limit": "32"}, "limit"),
        ({"start_time": "100", "group_by": "project_id"}, "group_by"),
        ({"start_time": "100", "page": "page_garbage"}, "page"),
        ({"start_time": "1" * 5000}, "start_time"),  # past int()'s digit limit: not a 500
        ({"start_time": "100", "limit": "9" * 5000}, "limit"),
    ],
)
def test_bad_parameters_are_openai_shaped_400s(
    sqlite_web_factory: sessionmaker[Session], settings: Settings, params: dict, param: str
) -> None:
    seed = add_tenant(sqlite_web_factory, "gamma", num_keys=1)
    client = TestClient(create_web_app(settings, sqlite_web_factory))
    response = client.get("/v1/organization/usage/completions", params=params,
                          headers={"Authorization": f"Bearer {seed.first_key}"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_forged_non_ascii_cookie_and_huge_invoice_id_are_refused_not_500(
    sqlite_web_factory: sessionmaker[Session], settings: Settings
) -> None:
    seed = add_tenant(sqlite_web_factory, "delta", num_keys=1)
    client = TestClient(create_web_app(settings, sqlite_web_factory))
    forged = b"kvtoll_session=e30.\xc3\xa9; kvtoll_admin=e30.\xc3\xa9"  # raw non-ASCII bytes
    for path in ("/dashboard", "/admin/dashboard"):
        assert client.get(path, headers={"cookie": forged}).status_code < 500, path
    response = client.get("/v1/invoices/" + "1" * 5000,
                          headers={"Authorization": f"Bearer {seed.first_key}"})
    assert response.status_code == 404 and response.json()["error"]["message"]


def test_missing_or_bad_key_is_401(
    sqlite_web_factory: sessionmaker[Session], settings: Settings
) -> None:
    client = TestClient(create_web_app(settings, sqlite_web_factory))
    for headers in ({}, {"Authorization": "Bearer kvt_nope"}, {"Authorization": "Basic xyz"}):
        response = client.get("/v1/organization/usage/completions",
                              params={"start_time": 0}, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
