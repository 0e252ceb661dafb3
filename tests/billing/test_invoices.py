"""Closing periods into invoices: idempotence, immutability, late usage, lines, exports, CLI."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest
import typer
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker
from typer.testing import CliRunner

from billing.accounts import create_tenant
from billing.errors import Conflict, InvalidInput
from billing.invoice_cli import register
from billing.invoice_export import exact_usd, load_document, to_csv, to_json, to_pdf
from billing.invoices import close_period, parse_period
from billing.ledger import LedgerEntry, write_usage
from billing.models import InvoiceLine, RequestStatus, ServedBy, Tenant, TenantId, UsageRecord
from billing.pricing import set_price
from tests.pdf_text import pdf_text

JAN = parse_period("2026-01")
FEB = parse_period("2026-02")


def _entry(tenant: Tenant, when: datetime, *, prompt: int, cached: int, completion: int,
           served_by: ServedBy = ServedBy.ENGINE, model: str = "m") -> LedgerEntry:
    return LedgerEntry(
        request_id=str(uuid.uuid4()), tenant_id=TenantId(tenant.id), api_key_id=None,
        model=model, served_by=served_by, status=RequestStatus.OK, prompt_tokens=prompt,
        cached_tokens=cached, completion_tokens=completion, similarity=None, worker=None,
        created_at=when,
    )


@pytest.fixture
def tenant(factory: sessionmaker[Session]) -> Tenant:
    with factory.begin() as session:
        # 1 USD/1M input = 1e6 pico/token; cached 0.5; output 4; semantic hits at 10 %.
        set_price(session, "m", "1", "0.5", "4", "0.1",
                  effective_from=datetime(2025, 1, 1, tzinfo=UTC))
        return create_tenant(session, "acme")


def _cli() -> typer.Typer:
    """The invoice group on a root of its own (the real root also loads other areas)."""
    app = typer.Typer()

    @app.callback()
    def root() -> None:
        """kvtoll"""

    register(app)
    return app


def _close(factory: sessionmaker[Session], tenant: Tenant, period: str) -> int:
    with factory.begin() as session:
        return close_period(session, tenant, parse_period(period)).id


def _lines(factory: sessionmaker[Session], invoice_id: int) -> list[tuple]:
    with factory() as session:
        rows = session.scalars(select(InvoiceLine).where(InvoiceLine.invoice_id == invoice_id))
        return [(r.model, r.kind, r.quantity, r.unit_pico, r.amount_pico, r.list_pico)
                for r in rows]


def test_lines_per_kind_with_quantities_prices_and_savings(
    factory: sessionmaker[Session], tenant: Tenant
) -> None:
    day = datetime(2026, 1, 10, tzinfo=UTC)
    write_usage(factory, _entry(tenant, day, prompt=1000, cached=400, completion=50))
    write_usage(factory, _entry(tenant, day, prompt=300, cached=0, completion=20,
                                served_by=ServedBy.SEMANTIC))
    invoice_id = _close(factory, tenant, "2026-01")
    semantic_list = 300 * 10**6 + 20 * 4 * 10**6
    assert _lines(factory, invoice_id) == [
        ("m", "uncached_input", 600, 10**6, 600 * 10**6, 600 * 10**6),
        ("m", "cached_input", 400, 5 * 10**5, 400 * 5 * 10**5, 400 * 10**6),
        ("m", "semantic_hit", 320, 0, semantic_list // 10, semantic_list),
        ("m", "output", 50, 4 * 10**6, 200 * 10**6, 200 * 10**6),
    ]
    with factory() as session:
        doc = load_document(session, invoice_id, None)
    assert doc.total_pico == 600 * 10**6 + 200 * 10**6 + 200 * 10**6 + semantic_list // 10
    assert doc.savings_pico == 400 * 5 * 10**5 + semantic_list - semantic_list // 10


def test_closing_twice_gives_the_same_invoice_and_late_usage_moves_on(
    factory: sessionmaker[Session], tenant: Tenant
) -> None:
    write_usage(factory, _entry(tenant, datetime(2026, 1, 5, tzinfo=UTC),
                                prompt=100, cached=0, completion=10))
    first = _close(factory, tenant, "2026-01")
    before = _lines(factory, first)
    # Late: arrives in January but is recorded after January was closed.
    write_usage(factory, _entry(tenant, datetime(2026, 1, 31, 23, 59, tzinfo=UTC),
                                prompt=7, cached=0, completion=1))
    write_usage(factory, _entry(tenant, datetime(2026, 2, 3, tzinfo=UTC),
                                prompt=50, cached=0, completion=5))
    assert _close(factory, tenant, "2026-01") == first
    assert _lines(factory, first) == before
    second = _close(factory, tenant, "2026-02")
    with factory() as session:
        jan, feb = (load_document(session, i, None) for i in (first, second))
        assert jan.total_pico == 100 * 10**6 + 10 * 4 * 10**6
        assert feb.total_pico == 57 * 10**6 + 6 * 4 * 10**6
        tagged = session.scalars(select(UsageRecord.invoice_id).order_by(UsageRecord.id)).all()
    assert tagged == [first, second, second]


def test_refuses_open_and_out_of_order_periods(
    factory: sessionmaker[Session], tenant: Tenant
) -> None:
    with factory() as session, pytest.raises(InvalidInput, match="has not ended"):
        close_period(session, tenant, parse_period("2999-01"))
    _close(factory, tenant, "2026-02")
    with factory() as session, pytest.raises(Conflict, match="later period 2026-02"):
        close_period(session, tenant, JAN)


@pytest.mark.parametrize("text", ["2026-13", "2026-1", "26-01", "2026/01", "", "1969-12"])
def test_bad_periods_are_refused(text: str) -> None:
    with pytest.raises(InvalidInput, match="YYYY-MM"):
        parse_period(text)


def test_exports_show_the_exact_total(
    factory: sessionmaker[Session], tenant: Tenant, tmp_path: Path
) -> None:
    write_usage(factory, _entry(tenant, datetime(2026, 1, 5, tzinfo=UTC),
                                prompt=123457, cached=1001, completion=999))
    invoice_id = _close(factory, tenant, "2026-01")
    with factory() as session:
        doc = load_document(session, invoice_id, None)
    total = exact_usd(doc.total_pico)
    assert json.loads(to_json(doc))["total_usd"] == total
    rows = list(csv.DictReader(io.StringIO(to_csv(doc))))
    assert rows[-1]["kind"] == "TOTAL" and rows[-1]["amount_usd"] == total
    pdf = tmp_path / "invoice.pdf"
    pdf.write_bytes(to_pdf(doc))
    text = pdf_text(pdf)
    if text is None:
        pytest.skip("pdftotext (poppler-utils) is not installed")
    assert f"Total due (USD): {total}" in text and "acme" in text


def test_the_pdf_library_loads_only_when_a_pdf_is_made() -> None:
    """Every gateway imports billing.invoice_export (the dashboard's labels): fpdf's 0.5 s
    import waits for the first PDF."""
    code = ("import sys, billing.invoice_export, web.app\n"
            "print('FPDF' if 'fpdf' in sys.modules else 'NO-FPDF')")
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["NO-FPDF"]


def test_cli_generate_export_and_one_line_errors(
    migrated_url: str, factory: sessionmaker[Session], tenant: Tenant, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVTOLL_DATABASE_URL", migrated_url)
    write_usage(factory, _entry(tenant, datetime(2026, 1, 5, tzinfo=UTC),
                                prompt=10, cached=0, completion=1))
    runner, app = CliRunner(), _cli()
    first = runner.invoke(app, ["invoice", "generate", "--period", "2026-01", "--tenant", "acme"])
    again = runner.invoke(app, ["invoice", "generate", "--period", "2026-01"])
    assert first.exit_code == 0 and again.exit_code == 0, first.output + again.output
    assert first.output.strip() == again.output.strip()
    invoice_id = first.output.split()[1]
    out = tmp_path / "inv.csv"
    done = runner.invoke(app, ["invoice", "export", invoice_id, "--format", "csv", "-o", str(out)])
    assert done.exit_code == 0 and "TOTAL" in out.read_text()
    for args in (
        ["invoice", "generate", "--period", "2026-13"],
        ["invoice", "generate", "--period", "2026-01", "--tenant", "nobody"],
        ["invoice", "export", "999", "--format", "csv", "-o", str(tmp_path / "x")],
        ["invoice", "export", invoice_id, "--format", "xml", "-o", str(tmp_path / "x")],
        ["invoice", "export", "abc", "--format", "pdf", "-o", str(tmp_path / "x")],
    ):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert len(result.output.strip().splitlines()) == 1
        assert result.output.startswith("error: ")
    assert not (tmp_path / "x").exists()


def test_cli_refuses_a_database_that_is_not_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVTOLL_DATABASE_URL", f"sqlite:///{tmp_path / 'missing.db'}")
    result = CliRunner().invoke(_cli(), ["invoice", "generate", "--period", "2026-01"])
    assert result.exit_code == 2 and "kvtoll db upgrade" in result.output
    assert not (tmp_path / "missing.db").exists()


def test_concurrent_closes_make_one_invoice(postgres_url: str) -> None:
    import threading

    from billing.db import make_engine, session_factory
    from billing.migrate import upgrade

    upgrade(postgres_url)
    engine = make_engine(postgres_url)
    factory = session_factory(engine)
    with factory.begin() as session:
        set_price(session, "m", "1", "0.5", "4", "0.1",
                  effective_from=datetime(2025, 1, 1, tzinfo=UTC))
        tenant = create_tenant(session, "racer")
    write_usage(factory, _entry(tenant, datetime(2026, 1, 3, tzinfo=UTC),
                                prompt=5, cached=0, completion=1))
    ids: list[int] = []
    barrier = threading.Barrier(4)

    def close() -> None:
        barrier.wait()
        with factory.begin() as session:
            ids.append(close_period(session, tenant, JAN).id)

    threads = [threading.Thread(target=close) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    with factory() as session:
        doc = load_document(session, ids[0], None)
    engine.dispose()
    assert len(ids) == 4 and len(set(ids)) == 1
    assert doc.total_pico == 5 * 10**6 + 4 * 10**6
