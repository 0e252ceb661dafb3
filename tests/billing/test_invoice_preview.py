"""Invoice preview: the open month as it stands, draft and unnumbered, never changing
a closed invoice; the same lines the month's invoice gets when it is closed."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker
from typer.testing import CliRunner

from billing.accounts import create_tenant
from billing.invoice_preview import preview_invoice, preview_payload
from billing.invoices import close_period, parse_period
from billing.ledger import write_usage
from billing.models import Invoice, Tenant, UsageRecord
from billing.pricing import set_price
from tests.billing.test_invoices import _cli, _close, _entry, _lines

MAR_15 = datetime(2026, 3, 15, 12, tzinfo=UTC)
M = 10**6  # pico per token of the fixture's 1 USD / 1M input price


@pytest.fixture
def tenant(factory: sessionmaker[Session]) -> Tenant:
    with factory.begin() as session:  # 1 USD/1M input, 0.5 cached, 4 output, hits at 10 %
        set_price(session, "m", "1", "0.5", "4", "0.1",
                  effective_from=datetime(2025, 1, 1, tzinfo=UTC))
        return create_tenant(session, "acme")


def _preview(factory: sessionmaker[Session], tenant: Tenant, now: datetime) -> dict:
    with factory() as session:
        return preview_payload(preview_invoice(session, tenant, now))


def _state(factory: sessionmaker[Session]) -> tuple[list, list]:
    with factory() as session:
        invoices = session.execute(select(Invoice.id, Invoice.total_pico, Invoice.list_pico)).all()
        tags = session.scalars(select(UsageRecord.invoice_id).order_by(UsageRecord.id)).all()
    return [tuple(i) for i in invoices], list(tags)


def test_preview_shows_the_open_month_and_late_rows_of_closed_months_only(
    factory: sessionmaker[Session], tenant: Tenant
) -> None:
    write_usage(factory, _entry(tenant, datetime(2026, 1, 5, tzinfo=UTC),
                                prompt=100, cached=0, completion=10))
    jan = _close(factory, tenant, "2026-01")
    jan_lines = _lines(factory, jan)
    # late January usage (recorded after January closed), February (not closed), March
    write_usage(factory, _entry(tenant, datetime(2026, 1, 31, 23, tzinfo=UTC),
                                prompt=7, cached=0, completion=1))
    write_usage(factory, _entry(tenant, datetime(2026, 2, 3, tzinfo=UTC),
                                prompt=50, cached=0, completion=5))
    write_usage(factory, _entry(tenant, datetime(2026, 3, 2, tzinfo=UTC),
                                prompt=1000, cached=400, completion=20))
    before = _state(factory)
    draft = _preview(factory, tenant, MAR_15)
    assert (draft["status"], draft["id"], draft["period"]) == ("draft", None, "2026-03")
    uncached = next(li for li in draft["lines"] if li["kind"] == "uncached_input")
    assert uncached["quantity"] == 600 + 7  # March's and the late January row, not February's
    expected = (607 * M) + 400 * M // 2 + 21 * 4 * M
    assert draft["total_pico"] == expected == sum(li["amount_pico"] for li in draft["lines"])
    assert _state(factory) == before  # nothing numbered, stored or tagged
    assert _lines(factory, jan) == jan_lines
    # Closing February takes the late row and February's; the preview moves on.
    with factory.begin() as session:
        close_period(session, tenant, parse_period("2026-02"), MAR_15)
    later = _preview(factory, tenant, MAR_15)
    assert later["total_pico"] == 600 * M + 400 * M // 2 + 20 * 4 * M
    # The preview's lines are the lines March's invoice gets when it is closed.
    with factory.begin() as session:
        march = close_period(session, tenant, parse_period("2026-03"),
                             datetime(2026, 4, 1, 0, 5, tzinfo=UTC)).id
    assert [
        (li["model"], li["kind"], li["quantity"], li["amount_pico"], li["list_pico"])
        for li in later["lines"]
    ] == [(m, k, q, a, lp) for m, k, q, _, a, lp in _lines(factory, march)]
    with factory() as session:
        assert session.scalar(select(func.count()).select_from(Invoice)) == 3


def test_cli_preview_json_text_and_errors(
    migrated_url: str, factory: sessionmaker[Session], tenant: Tenant,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVTOLL_DATABASE_URL", migrated_url)
    write_usage(factory, _entry(tenant, datetime.now(UTC), prompt=10, cached=0, completion=1))
    runner, app = CliRunner(), _cli()
    result = runner.invoke(app, ["invoice", "preview", "--tenant", "acme", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["status"] == "draft" and payload["id"] is None
    assert payload["period"] == f"{datetime.now(UTC):%Y-%m}"
    assert payload["total_usd"] == "0.000014"  # 10 x 1 USD/1M + 1 x 4 USD/1M
    text = runner.invoke(app, ["invoice", "preview", "--tenant", "acme"])
    assert text.exit_code == 0 and "status=draft" in text.stdout
    assert "total_usd=0.000014" in text.stdout
    for args in (["invoice", "preview", "--tenant", "nobody"], ["invoice", "preview"]):
        refused = runner.invoke(app, args)
        assert refused.exit_code == 2, refused.output
        assert refused.output.startswith("error: ") or "Missing option" in refused.output
    with factory() as session:
        assert session.scalar(select(func.count()).select_from(Invoice)) == 0
