"""Spend budgets in the database (SQLite and PostgreSQL): set, replace, remove, list with
this month's spend from the ledger, one-line CLI errors that change nothing."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import typer
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker
from typer.testing import CliRunner

from billing.accounts import create_key, create_tenant
from billing.budgets import (
    budget_statuses,
    list_budgets,
    month_to_date_spend,
    parse_alert_at,
    parse_monthly_usd,
    remove_budget,
    set_budget,
)
from billing.cli import register
from billing.errors import InvalidInput, NotFound
from billing.ledger import LedgerEntry, write_usage_many
from billing.models import ApiKeyId, Budget, RequestStatus, ServedBy, TenantId
from billing.pricing import set_price

NOW = datetime(2026, 3, 15, 12, tzinfo=UTC)
M = 10**6  # pico per token at 1 USD per 1M tokens


def _entry(tenant_id: int, key_id: str | None, when: datetime, prompt: int) -> LedgerEntry:
    return LedgerEntry(
        request_id=str(uuid.uuid4()), tenant_id=TenantId(tenant_id),
        api_key_id=None if key_id is None else ApiKeyId(key_id), model="m",
        served_by=ServedBy.ENGINE, status=RequestStatus.OK, prompt_tokens=prompt,
        cached_tokens=0, completion_tokens=0, similarity=None, worker=None, created_at=when,
    )


@pytest.fixture
def world(factory: sessionmaker[Session]) -> dict[str, Any]:
    with factory.begin() as s:
        set_price(s, "m", "1", "0.5", "2", "0.1", effective_from=datetime(2025, 1, 1, tzinfo=UTC))
        acme, other = create_tenant(s, "acme"), create_tenant(s, "other")
        key, _ = create_key(s, "acme")
        foreign, _ = create_key(s, "other")
        ids: dict[str, Any] = {
            "acme": acme.id, "other": other.id, "key": key.id, "foreign": foreign.id,
        }
    write_usage_many(factory, [
        _entry(ids["acme"], ids["key"], NOW - timedelta(days=2), 300),  # this month, the key
        _entry(ids["acme"], None, NOW - timedelta(days=1), 200),  # this month, no key
        _entry(ids["acme"], ids["key"], datetime(2026, 2, 27, tzinfo=UTC), 5000),  # February
        _entry(ids["other"], ids["foreign"], NOW, 70),
    ])
    return ids


def test_set_replace_list_and_remove(factory: sessionmaker[Session], world: dict) -> None:
    with factory.begin() as s:
        tenant = set_budget(s, "acme", None, "0.0004", now=NOW)
        assert (tenant.terms.limit_pico, tenant.terms.alert_ppm) == (400 * M, 800_000)
        keyed = set_budget(s, "acme", world["key"], "0.0002", "0.5", now=NOW)
        assert keyed.api_key_id == world["key"] and keyed.terms.alert_ppm == 500_000
        again = set_budget(s, "acme", world["key"], "0.001", now=NOW)  # keeps its alert
        assert (again.terms.limit_pico, again.terms.alert_ppm) == (1000 * M, 500_000)
    with factory() as s:
        statuses = budget_statuses(s, None, NOW)
        assert [(b.budget.api_key_id, b.spent_pico, b.state) for b in statuses] == [
            (None, 500 * M, "exceeded"), (world["key"], 300 * M, "ok"),
        ]
        assert [b.tenant_name for b in list_budgets(s, world["other"])] == []
    with factory.begin() as s:
        set_budget(s, "acme", world["key"], "0.0005", now=NOW)
    with factory() as s:
        assert budget_statuses(s, world["acme"], NOW)[1].state == "alert"  # 300 of 500 >= 0.5
    with factory.begin() as s:
        remove_budget(s, "acme", None)
        with pytest.raises(NotFound, match="no tenant-wide budget"):
            remove_budget(s, "acme", None)
    with factory() as s:
        assert [b.api_key_id for b in list_budgets(s)] == [world["key"]]


def test_month_to_date_spend_is_the_ledgers(factory: sessionmaker[Session], world: dict) -> None:
    with factory() as s:
        spend = month_to_date_spend(s, NOW)
    assert spend.tenants == {world["acme"]: 500 * M, world["other"]: 70 * M}
    assert spend.keys == {world["key"]: 300 * M, world["foreign"]: 70 * M}


@pytest.mark.parametrize(
    ("tenant", "key", "usd", "alert", "error"),
    [
        ("acme", None, "-1", None, InvalidInput), ("acme", None, "abc", None, InvalidInput),
        ("acme", None, "1e400", None, InvalidInput), ("acme", None, "2000000", None, InvalidInput),
        ("acme", None, "0.0000000000001", None, InvalidInput),
        ("acme", None, "1", "0", InvalidInput), ("acme", None, "1", "1.5", InvalidInput),
        ("acme", None, "NaN", None, InvalidInput), ("nobody", None, "1", None, NotFound),
        ("acme", "key_bad", "1", None, InvalidInput), ("acme", "foreign", "1", None, NotFound),
    ],
)
def test_bad_budgets_are_refused_and_change_nothing(
    factory: sessionmaker[Session], world: dict, tenant: str, key: str | None, usd: str,
    alert: str | None, error: type[Exception],
) -> None:
    key_id = world.get(key, key) if key else None
    with factory() as s, pytest.raises(error):
        set_budget(s, tenant, key_id, usd, alert)
    with factory() as s:
        assert s.scalars(select(Budget)).all() == []


def test_parsing_is_exact() -> None:
    assert parse_monthly_usd("12.345678901234") == 12_345_678_901_234
    assert parse_monthly_usd("0") == 0
    assert parse_alert_at("1") == 1_000_000 and parse_alert_at("0.83") == 830_000


def _cli() -> typer.Typer:
    app = typer.Typer()
    register(app)
    return app


def test_cli_budget_set_list_remove_and_errors(
    migrated_url: str, factory: sessionmaker[Session], world: dict,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVTOLL_DATABASE_URL", migrated_url)
    runner, app = CliRunner(), _cli()
    done = runner.invoke(app, ["budget", "set", "acme", "--monthly-usd", "25", "--alert-at", "0.9"])
    assert done.exit_code == 0, done.output
    assert "25.00 USD per month, alert at 0.9" in done.stdout
    keyed = runner.invoke(app, ["budget", "set", "acme", "--key", world["key"],
                                "--monthly-usd", "0.0003"])
    assert keyed.exit_code == 0, keyed.output
    listed = runner.invoke(app, ["budget", "list"])
    assert listed.exit_code == 0, listed.output
    lines = listed.stdout.strip().splitlines()
    assert lines[0].split("\t") == ["tenant", "key_id", "monthly_usd", "alert_at", "period",
                                    "spent_usd", "used", "state"]
    assert lines[1].split("\t")[:4] == ["acme", "-", "25.00", "0.9"]
    key_row = lines[2].split("\t")
    assert key_row[:3] == ["acme", world["key"], "0.0003"] and key_row[-1] in ("ok", "exceeded")
    for args in (
        ["budget", "set", "acme", "--monthly-usd", "-5"],
        ["budget", "set", "acme", "--monthly-usd", "5", "--alert-at", "2"],
        ["budget", "set", "nobody", "--monthly-usd", "5"],
        ["budget", "set", "acme", "--key", world["foreign"], "--monthly-usd", "5"],
        ["budget", "remove", "other"],
    ):
        with factory() as s:
            before = [(b.tenant_id, b.api_key_id, b.monthly_limit_pico, b.alert_ppm)
                      for b in s.scalars(select(Budget))]
        refused = runner.invoke(app, args)
        assert refused.exit_code == 2, (args, refused.output)
        assert refused.stderr.startswith("error: ") and refused.stderr.count("\n") == 1
        with factory() as s:
            assert [(b.tenant_id, b.api_key_id, b.monthly_limit_pico, b.alert_ppm)
                    for b in s.scalars(select(Budget))] == before
    removed = runner.invoke(app, ["budget", "remove", "acme", "--key", world["key"]])
    assert removed.exit_code == 0, removed.output
    with factory() as s:
        assert [b.api_key_id for b in list_budgets(s)] == [None]
