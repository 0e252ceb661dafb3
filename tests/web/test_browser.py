"""Real headless Chromium (Debian's ``chromium``) driving the dashboards over HTTP.

Signs in with a key, checks the shown totals against the ledger, downloads an
invoice, checks tenant isolation through pages and APIs, and saves screenshots at
laptop and phone widths (to ``tmp_path`` and ``bench/out/``).
"""

from __future__ import annotations

import random
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import uvicorn
from sqlalchemy.orm import Session, sessionmaker

from billing.invoice_export import exact_usd
from billing.invoices import close_period, parse_period
from billing.models import Tenant
from billing.money import display_usd
from kvtoll.settings import Settings
from tests.pdf_text import pdf_text
from tests.web.webseed import (
    ADMIN_TOKEN,
    TenantSeed,
    add_prices,
    add_tenant,
    ledger_money,
    random_entries,
    record,
)
from web.app import create_web_app

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]
PERIOD = parse_period("2026-01")
OUT_DIR = Path(__file__).resolve().parents[2] / "bench" / "out"
LAPTOP = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(), reason="/usr/bin/chromium not installed (apt-get install chromium)"
)


@dataclass
class Site:
    base: str
    factory: sessionmaker[Session]
    alpha: TenantSeed
    beta: TenantSeed
    alpha_invoice: int
    beta_invoice: int


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _close(factory: sessionmaker[Session], seed: TenantSeed) -> int:
    with factory.begin() as session:
        tenant = session.get(Tenant, seed.tenant_id)
        assert tenant is not None
        return close_period(session, tenant, PERIOD).id


@pytest.fixture
def site(sqlite_web_factory: sessionmaker[Session], settings: Settings) -> Iterator[Site]:
    factory = sqlite_web_factory
    add_prices(factory)
    rng = random.Random(11)
    alpha, beta = add_tenant(factory, "alpha"), add_tenant(factory, "beta-corp")
    record(factory, alpha, random_entries(rng, alpha, PERIOD.start, 31, 80))
    record(factory, beta, random_entries(rng, beta, PERIOD.start, 31, 50))
    alpha_invoice, beta_invoice = _close(factory, alpha), _close(factory, beta)
    # the columns the routing fleet reports (proxy.routing.fleet), one worker up, one down
    workers = [
        {"name": f"http://10.0.0.{i}:9000", "healthy": i == 5, "url": "inproc://engine",
         "source": "static", "kv_events": True, "running": 12, "waiting": 3,
         "free_blocks": "61234/65536", "pending_prefill_tokens": 123456,
         "indexed_blocks": 65536}
        for i in (5, 6)
    ]
    # the rows the gateway's semantic cache reports (proxy.semantic.report.bound_rows)
    semantic = [
        {"tenant_id": alpha.tenant_id, "tenant": "alpha", "hits": 1234, "explored": 61,
         "explored_checked": 60, "explored_wrong": 1, "feedback_wrong": 0,
         "wrong_hit_rate": 1 / 60, "wrong_hit_rate_low": 0.0029, "wrong_hit_rate_high": 0.0886,
         "max_error_rate": 0.02},
        {"tenant_id": beta.tenant_id, "tenant": "beta-corp", "hits": 5, "explored": 0,
         "explored_checked": 0, "explored_wrong": 0, "feedback_wrong": 0, "wrong_hit_rate": None,
         "wrong_hit_rate_low": 0.0, "wrong_hit_rate_high": 1.0, "max_error_rate": 0.05},
    ]
    app = create_web_app(settings, factory, worker_status=lambda: workers,
                         semantic_status=lambda: semantic)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield Site(f"http://127.0.0.1:{port}", factory, alpha, beta, alpha_invoice, beta_invoice)
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    """One Chromium for the module (each test opens its own context: no shared cookies)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


def _shot(page: object, tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    page.screenshot(path=str(path), full_page=True)  # type: ignore[attr-defined]
    try:
        OUT_DIR.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, OUT_DIR / name)
    except OSError:
        pass


def _assert_money(page: object, selector: str, pico: int) -> None:
    """Shown to the cent (or 4 significant digits under it), exact in the tooltip."""
    assert page.inner_text(selector) == display_usd(pico)  # type: ignore[attr-defined]
    shown = page.locator(f"{selector} .usd")  # type: ignore[attr-defined]
    assert shown.get_attribute("title") == f"{exact_usd(pico)} USD"
    assert shown.get_attribute("data-exact") == exact_usd(pico)


def _assert_tables_fit(page: object) -> None:
    """At this width no table scrolls sideways: every column, "Saved $" included, shows."""
    overflowing = page.evaluate(  # type: ignore[attr-defined]
        "[...document.querySelectorAll('.table-wrap')]"
        ".filter(w => w.scrollWidth > w.clientWidth + 1)"
        ".map(w => w.querySelector('table').id)"
    )
    assert overflowing == []
    assert page.evaluate("document.documentElement.scrollWidth") <= LAPTOP["width"]  # type: ignore[attr-defined]


def _sign_in(page: object, site: Site, key: str) -> None:
    page.goto(site.base + "/dashboard")  # type: ignore[attr-defined]
    page.fill("#api_key", key)  # type: ignore[attr-defined]
    page.click("button[type=submit]")  # type: ignore[attr-defined]
    page.wait_for_selector("#tenant-name")  # type: ignore[attr-defined]


def _pick_range(page: object) -> None:
    page.fill("#range-start", PERIOD.start.date().isoformat())  # type: ignore[attr-defined]
    page.fill("#range-end", "2026-01-31")  # type: ignore[attr-defined]
    page.click("#range-apply")  # type: ignore[attr-defined]
    page.wait_for_url("**start=2026-01-01**")  # type: ignore[attr-defined]


def test_tenant_dashboard_shows_the_ledger_and_downloads_invoices(
    site: Site, browser: object, tmp_path: Path
) -> None:
    context = browser.new_context(viewport=LAPTOP, accept_downloads=True)  # type: ignore[attr-defined]
    page = context.new_page()
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    _sign_in(page, site, site.alpha.first_key)
    cookie = next(c for c in context.cookies() if c["name"] == "kvtoll_session")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Lax"
    assert site.alpha.first_key not in cookie["value"] and cookie["expires"] > time.time()
    _pick_range(page)
    with site.factory() as session:
        billed, listed = ledger_money(session, site.alpha.tenant_id, PERIOD.start, PERIOD.end)
    sent = site.alpha.entries
    assert page.inner_text("#tenant-name") == "alpha"
    assert page.inner_text("#total-requests") == f"{len(sent):,}"
    assert page.inner_text("#total-input-tokens") == f"{sum(e.prompt_tokens for e in sent):,}"
    assert page.inner_text("#total-cached-tokens") == f"{sum(e.cached_tokens for e in sent):,}"
    assert page.inner_text("#total-output-tokens") == f"{sum(e.completion_tokens for e in sent):,}"
    _assert_money(page, "#total-billed", billed)
    _assert_money(page, "#total-list", listed)
    _assert_money(page, "#total-savings", listed - billed)
    bound = page.locator("#semantic-bound tbody tr td").all_inner_texts()
    assert bound == ["1,234", "61", "60", "1.67%", "0.29% – 8.86%", "2.00%"]
    _assert_tables_fit(page)
    drawn = page.evaluate(
        "['chart-requests','chart-layers','chart-hit-rates','chart-spend']"
        ".every(id => Chart.getChart(document.getElementById(id)) !== undefined)"
    )
    assert drawn is True
    _shot(page, tmp_path, "dashboard-laptop.png")

    row = page.locator(f"tr[data-invoice-id='{site.alpha_invoice}']")
    _assert_money(page, f"tr[data-invoice-id='{site.alpha_invoice}'] .invoice-total", billed)
    with page.expect_download() as info:
        row.locator("a.dl-pdf").click()
    pdf = tmp_path / "invoice.pdf"
    info.value.save_as(str(pdf))
    text = pdf_text(pdf)
    if text is not None:
        assert f"Total due (USD): {exact_usd(billed)}" in text
    assert errors == []

    page.set_viewport_size(PHONE)
    page.reload()
    page.wait_for_selector("#total-requests")
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= PHONE["width"], f"page scrolls sideways on a phone ({width}px)"
    _shot(page, tmp_path, "dashboard-phone.png")
    context.close()


def test_tenant_a_never_sees_tenant_b(site: Site, browser: object) -> None:
    context = browser.new_context(viewport=LAPTOP)  # type: ignore[attr-defined]
    page = context.new_page()
    _sign_in(page, site, site.alpha.first_key)
    _pick_range(page)
    html = page.content()
    assert "beta-corp" not in html and "5.00%" not in html  # beta's bound
    assert not any(key_id in html for key_id in site.beta.keys)
    assert page.locator(f"tr[data-invoice-id='{site.beta_invoice}']").count() == 0
    # The session cookie rides along with API calls made from the page's context.
    theirs = context.request.get(f"{site.base}/v1/invoices/{site.beta_invoice}/download?format=pdf")
    assert theirs.status == 404
    listed = context.request.get(f"{site.base}/v1/invoices").json()
    assert [i["id"] for i in listed["data"]] == [site.alpha_invoice]
    usage = context.request.get(
        f"{site.base}/v1/organization/usage/completions?group_by=api_key&limit=31"
        f"&start_time={int(PERIOD.start.timestamp())}&end_time={int(PERIOD.end.timestamp())}"
    ).json()
    seen = {r["api_key_id"] for b in usage["data"] for r in b["results"]}
    assert seen == set(site.alpha.keys)
    page.click("#sign-out")
    page.wait_for_selector("#api_key")
    after = context.request.get(f"{site.base}/v1/invoices")
    assert after.status == 401
    context.close()


def test_bad_key_is_refused_and_admin_sees_every_tenant(
    site: Site, browser: object, tmp_path: Path
) -> None:
    context = browser.new_context(viewport=LAPTOP)  # type: ignore[attr-defined]
    page = context.new_page()
    page.goto(site.base + "/dashboard")
    page.fill("#api_key", "kvt_not-a-real-key")
    page.click("button[type=submit]")
    assert "not valid" in page.inner_text("#error")
    page.goto(site.base + "/admin/dashboard")
    page.fill("#admin_token", "wrong-token")
    page.click("button[type=submit]")
    assert "not valid" in page.inner_text("#error")
    page.fill("#admin_token", ADMIN_TOKEN)
    page.click("button[type=submit]")
    page.wait_for_selector("#tenants")
    page.goto(site.base + "/admin/dashboard?start=2026-01-01&end=2026-01-31")
    tenants = page.inner_text("#tenants")
    assert "alpha" in tenants and "beta-corp" in tenants
    workers = page.inner_text("#workers")
    assert "inproc://engine" in workers and "True" not in workers
    statuses = page.locator("#workers tbody tr td:nth-child(2)").all_inner_texts()
    assert statuses == ["up", "down"]
    rows = page.locator("#semantic-bound tbody tr")
    assert rows.nth(0).locator("td").all_inner_texts() == [
        "alpha", "1,234", "61", "60", "1.67%", "0.29% – 8.86%", "2.00%"]
    assert rows.nth(1).locator("td").all_inner_texts() == [
        "beta-corp", "5", "0", "0", "-", "-", "5.00%"]
    _assert_tables_fit(page)
    with site.factory() as session:
        totals = [ledger_money(session, s.tenant_id, PERIOD.start, PERIOD.end)
                  for s in (site.alpha, site.beta)]
    _assert_money(page, "#total-billed", sum(b for b, _ in totals))
    _shot(page, tmp_path, "admin-laptop.png")
    page.set_viewport_size(PHONE)
    page.reload()
    _shot(page, tmp_path, "admin-phone.png")
    context.close()
