"""Property: over random ledgers, invoice totals and lines equal the ledger sums exactly."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from billing.accounts import create_tenant, require_tenant
from billing.invoice_export import exact_usd, load_document, to_pdf
from billing.invoices import close_period, parse_period
from billing.ledger import LedgerEntry, write_usage_many
from billing.models import RequestStatus, ServedBy, TenantId, UsageRecord
from billing.pricing import set_price
from tests.pdf_text import pdf_text

PERIOD = parse_period("2025-06")
PRICE_FROM = datetime(2025, 1, 1, tzinfo=UTC)
prices = st.tuples(
    st.decimals(0, 50, places=6), st.decimals(0, 1, places=6), st.decimals(0, 80, places=6),
    st.decimals(0, 1, places=6),
)


@st.composite
def requests(draw: st.DrawFn) -> tuple[int, int, int, bool, int, int]:
    prompt = draw(st.integers(0, 200_000))
    return (
        prompt,
        draw(st.integers(0, prompt)),
        draw(st.integers(0, 50_000)),
        draw(st.booleans()),
        draw(st.integers(0, 2)),  # model index; model 2 has no price
        draw(st.integers(-5 * 86400, 35 * 86400)),  # seconds from the period start
    )


def _setup(session: Session, tag: str, price_list: list) -> tuple[int, list[str]]:
    models = [f"m{i}-{tag}" for i in range(3)]
    for model, (inp, cached_share, out, frac) in zip(models, price_list, strict=False):
        cached = (inp * cached_share).quantize(Decimal("0.000001"))
        set_price(session, model, inp, min(cached, inp), out, frac, effective_from=PRICE_FROM)
    return create_tenant(session, f"t-{tag}").id, models


def _pdf_text(tmp: Path, data: bytes) -> str | None:
    tmp.write_bytes(data)
    return pdf_text(tmp)


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(price_list=st.lists(prices, min_size=2, max_size=2), reqs=st.lists(requests(), max_size=30))
def test_invoice_equals_ledger(
    sqlite_factory: sessionmaker[Session], tmp_path: Path, price_list: list, reqs: list
) -> None:
    tag = uuid.uuid4().hex[:10]
    with sqlite_factory.begin() as session:
        tenant_id, models = _setup(session, tag, price_list)
    entries = [
        LedgerEntry(
            request_id=str(uuid.uuid4()), tenant_id=TenantId(tenant_id), api_key_id=None,
            model=models[m], served_by=ServedBy.SEMANTIC if sem else ServedBy.ENGINE,
            status=RequestStatus.OK, prompt_tokens=p, cached_tokens=c, completion_tokens=o,
            similarity=None, worker=None, created_at=PERIOD.start + timedelta(seconds=offset),
        )
        for p, c, o, sem, m, offset in reqs
    ]
    write_usage_many(sqlite_factory, entries)
    with sqlite_factory.begin() as session:
        tenant = require_tenant(session, f"t-{tag}")
        invoice_id = close_period(session, tenant, PERIOD).id
    r = UsageRecord
    in_scope = (r.tenant_id == tenant_id, r.created_at < PERIOD.end)
    with sqlite_factory() as session:
        billed, listed, count = session.execute(
            select(func.coalesce(func.sum(r.billed_pico), 0),
                   func.coalesce(func.sum(r.list_pico), 0), func.count()).where(*in_scope)
        ).one()
        doc = load_document(session, invoice_id, tenant_id)
        # Re-closing changes nothing.
        assert close_period(session, tenant, PERIOD).id == invoice_id
    assert count == sum(1 for *_, offset in reqs if offset < 30 * 86400)
    assert doc.total_pico == billed and doc.list_pico == listed
    assert sum(line.amount_pico for line in doc.lines) == billed
    assert sum(line.list_pico for line in doc.lines) == listed
    assert all(line.kind != "adjustment" or line.amount_pico == 0 for line in doc.lines)
    engine_out = sum(o for p, c, o, sem, m, off in reqs if not sem and off < 30 * 86400)
    assert sum(x.quantity for x in doc.lines if x.kind == "output") == engine_out
    if len(reqs) % 3 == 0:  # the PDF check on a third of the examples (it is slow)
        text = _pdf_text(tmp_path / f"{tag}.pdf", to_pdf(doc))
        assert text is None or f"Total due (USD): {exact_usd(billed)}" in text
