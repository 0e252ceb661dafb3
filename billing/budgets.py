"""Spend budgets: per tenant and per key, a monthly limit in USD and a soft alert.

A budget is a hard limit in picodollars per UTC calendar month (requests are
refused once the month's spend reaches it; the gateway enforces it, see
``proxy/budget.py``) and an alert threshold, a fraction of the limit (default 0.8)
past which the dashboards, ``/metrics`` and a response header warn. A tenant-wide
budget counts every key's spend; a key's budget counts that key's only; both may
apply to one request.

Month-to-date spend is the ledger's billed amount of the month, read from the hourly
rollup (:mod:`billing.usage_rollup`: it equals the ledger exactly), so the figures
here are what the invoice will say. Services run in the caller's transaction and
raise :class:`~billing.errors.BillingError` subclasses for a caller's mistake.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from billing import keys
from billing.accounts import require_tenant
from billing.errors import InvalidInput, NotFound
from billing.models import NO_API_KEY, ApiKey, Budget, Tenant, UsageHourly
from billing.money import PPM, parse_fraction_ppm, ppm_to_fraction, usd_to_pico

DEFAULT_ALERT_PPM = 800_000  # alert at 80 % of the limit
MAX_BUDGET_USD = Decimal(1_000_000)  # 1e18 pico: far from the int64 columns' limit


@dataclass(frozen=True)
class BudgetTerms:
    """What the gateway enforces for one scope: the month's limit and its alert share."""

    limit_pico: int
    alert_ppm: int

    def alert_reached(self, spent_pico: int) -> bool:
        return spent_pico * PPM >= self.limit_pico * self.alert_ppm

    def percent_used(self, spent_pico: int) -> int:
        """Whole percent of the limit spent (rounded down; a zero limit counts as 100)."""
        return 100 if self.limit_pico == 0 else spent_pico * 100 // self.limit_pico


@dataclass(frozen=True)
class BudgetRow:
    """One stored budget; ``api_key_id`` ``None`` is the tenant-wide one."""

    tenant_id: int
    tenant_name: str
    api_key_id: str | None
    terms: BudgetTerms
    updated_at: datetime

    @property
    def alert_at(self) -> Decimal:
        return ppm_to_fraction(self.terms.alert_ppm)


@dataclass(frozen=True)
class BudgetStatus:
    """A budget and its month-to-date spend from the ledger."""

    budget: BudgetRow
    period: str
    spent_pico: int

    @property
    def alert(self) -> bool:
        return self.budget.terms.alert_reached(self.spent_pico)

    @property
    def exceeded(self) -> bool:
        return self.spent_pico >= self.budget.terms.limit_pico

    @property
    def state(self) -> str:
        return "exceeded" if self.exceeded else "alert" if self.alert else "ok"


def parse_monthly_usd(text: str | Decimal | int) -> int:
    """A monthly limit in USD (exact, >= 0, <= 1,000,000) as picodollars."""
    try:
        pico = usd_to_pico(str(text).strip() if isinstance(text, str | int) else text)
    except InvalidInput as exc:
        raise InvalidInput(str(exc).replace("amount", "monthly budget (USD)", 1)) from None
    if pico < 0:
        raise InvalidInput(f"monthly budget must not be negative, got {text!r}")
    if pico > usd_to_pico(MAX_BUDGET_USD):
        raise InvalidInput(f"monthly budget must be at most {MAX_BUDGET_USD} USD")
    return pico


def parse_alert_at(text: str | Decimal | int) -> int:
    """An alert threshold, a fraction of the limit in (0, 1], as parts per million."""
    ppm = parse_fraction_ppm(text, "alert threshold")
    if ppm == 0:
        raise InvalidInput("alert threshold must be above 0 (and at most 1)")
    return ppm


def month_start(now: datetime) -> datetime:
    """Midnight UTC of the first day of ``now``'s month."""
    moment = now.astimezone(UTC)
    return datetime(moment.year, moment.month, 1, tzinfo=UTC)


def _scope_key(session: Session, tenant: Tenant, key_id: str | None) -> str:
    if key_id is None:
        return NO_API_KEY
    if not keys.check_key_id(key_id):
        raise InvalidInput(f"malformed key id {key_id!r} (expected key_ + 20 characters)")
    key = session.get(ApiKey, key_id)
    if key is None or key.tenant_id != tenant.id:
        raise NotFound(f"tenant {tenant.name!r} has no key {key_id!r}")
    return key_id


def set_budget(
    session: Session, tenant_name: str, key_id: str | None, monthly_usd: str | Decimal | int,
    alert_at: str | Decimal | int | None = None, now: datetime | None = None,
) -> BudgetRow:
    """Create or replace the budget of a tenant (``key_id`` None) or of one of its keys.
    ``alert_at`` None keeps the current threshold (0.8 for a new budget)."""
    limit = parse_monthly_usd(monthly_usd)
    alert = None if alert_at is None else parse_alert_at(alert_at)
    tenant = require_tenant(session, tenant_name)
    scope = _scope_key(session, tenant, key_id)
    row = session.get(Budget, (tenant.id, scope), with_for_update=True)
    moment = now or datetime.now(UTC)
    if row is None:
        row = Budget(tenant_id=tenant.id, api_key_id=scope, monthly_limit_pico=limit,
                     alert_ppm=alert or DEFAULT_ALERT_PPM, updated_at=moment)
        session.add(row)
    else:
        row.monthly_limit_pico, row.updated_at = limit, moment
        row.alert_ppm = alert or row.alert_ppm
    session.flush()
    return _row(row, tenant.name)


def remove_budget(session: Session, tenant_name: str, key_id: str | None) -> None:
    """Delete a budget; :class:`NotFound` if there is none."""
    tenant = require_tenant(session, tenant_name)
    scope = _scope_key(session, tenant, key_id)
    row = session.get(Budget, (tenant.id, scope))
    if row is None:
        what = "tenant-wide" if key_id is None else f"key {key_id}"
        raise NotFound(f"tenant {tenant.name!r} has no {what} budget")
    session.delete(row)
    session.flush()


def _row(budget: Budget, tenant_name: str) -> BudgetRow:
    return BudgetRow(
        budget.tenant_id, tenant_name, budget.api_key_id or None,
        BudgetTerms(budget.monthly_limit_pico, budget.alert_ppm), budget.updated_at,
    )


def list_budgets(session: Session, tenant_id: int | None = None) -> list[BudgetRow]:
    """Budgets by tenant name, the tenant-wide one before its keys'."""
    stmt = select(Budget, Tenant.name).join(Tenant, Budget.tenant_id == Tenant.id)
    if tenant_id is not None:
        stmt = stmt.where(Budget.tenant_id == tenant_id)
    rows = session.execute(stmt.order_by(Tenant.name, Budget.api_key_id)).tuples().all()
    return [_row(budget, name) for budget, name in rows]


@dataclass(frozen=True)
class MonthSpend:
    """Billed picodollars of one month so far, per tenant and per key."""

    tenants: Mapping[int, int]
    keys: Mapping[str, int]


def month_to_date_spend(
    session: Session, now: datetime, tenant_ids: Iterable[int] | None = None
) -> MonthSpend:
    """The ledger's billed amounts since the start of ``now``'s month (one query)."""
    h = UsageHourly
    stmt = (
        select(h.tenant_id, h.api_key_id, func.sum(h.billed_pico))
        .where(h.hour >= month_start(now))
        .group_by(h.tenant_id, h.api_key_id)
    )
    if tenant_ids is not None:
        stmt = stmt.where(h.tenant_id.in_(list(tenant_ids)))
    tenants: dict[int, int] = {}
    per_key: dict[str, int] = {}
    for tenant_id, key_id, billed in session.execute(stmt):
        tenants[tenant_id] = tenants.get(tenant_id, 0) + int(billed)
        if key_id != NO_API_KEY:
            per_key[key_id] = per_key.get(key_id, 0) + int(billed)
    return MonthSpend(tenants, per_key)


def spent_on(budget: BudgetRow, spend: MonthSpend) -> int:
    """The month-to-date spend that counts against ``budget``."""
    if budget.api_key_id is None:
        return spend.tenants.get(budget.tenant_id, 0)
    return spend.keys.get(budget.api_key_id, 0)


def budget_statuses(
    session: Session, tenant_id: int | None = None, now: datetime | None = None
) -> list[BudgetStatus]:
    """Every budget (of ``tenant_id``, or all) with its month-to-date spend."""
    moment = now or datetime.now(UTC)
    budgets = list_budgets(session, tenant_id)
    if not budgets:
        return []
    spend = month_to_date_spend(session, moment, {b.tenant_id for b in budgets})
    period = f"{moment.astimezone(UTC):%Y-%m}"
    return [BudgetStatus(b, period, spent_on(b, spend)) for b in budgets]
