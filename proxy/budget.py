"""Spend budgets at admission: reserve the most a request can cost, settle what it cost.

Algorithm, per request of a tenant or key with a budget (:mod:`billing.budgets`)::

    hold:    worst = rate(prompt tokens, no cache, max_tokens x n completion tokens)
                     .list_pico  (never below what the ledger will bill)
             counters.reserve([tenant, key], [limits], worst)   one atomic step
             any counter >= its limit ─► 429 budget_exceeded (nothing reserved,
                                          nothing billed: no ledger row)
    settle:  when metering records the request's ledger entry:
             counters.add(actual - worst), actual = rate(entry, price in force)
             (a request that never reached the ledger releases its whole hold)

Counters are the month-to-date spend in picodollars, kept by :mod:`proxy.spend` in
the rate limits' store (Redis, shared by every gateway, or in-process). A counter
holds the settled spend plus the holds of requests in flight, so concurrent
requests see each other's worst case: a request is admitted only while the spend
so far is under the limit, so the month ends at most one request over it (with
Redis for all gateways together; in-process, per gateway).

Nothing here touches the database per request. Budgets and prices are loaded into
memory every ``refresh_s`` (the key cache's TTL: a new or changed budget applies
within it) and the counters are reconciled with the ledger each time
(``raise_to`` the month's billed sums from the hourly rollup), which repairs a
counter that missed spend (Redis restarted, a gateway started mid-month, local
fallback) without ever dropping the holds in flight. A database that cannot be read
keeps the last loaded budgets; one that could never be read enforces none.

Soft alert: when a budget's spend (at admission) reaches ``alert_at`` of its limit
the response carries ``x-kvtoll-budget-alert: NN%`` (the highest share of a budget
that applies); ``/metrics`` has ``kvtoll_budget_used_ratio`` and
``kvtoll_budget_alert`` per budget, refreshed at each reconciliation and admission.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

import anyio
from sqlalchemy.orm import Session, sessionmaker

from billing.accounts import KeyIdentity
from billing.budgets import BudgetRow, BudgetTerms, list_budgets, month_to_date_spend, spent_on
from billing.ledger import LedgerEntry
from billing.models import ServedBy
from billing.money import exact_usd
from billing.price_book import PriceBook
from billing.rating import Usage, rate
from kvtoll.openai.errors import OpenAIError
from proxy.metrics import ProxyMetrics
from proxy.spend import SpendCounters

log = logging.getLogger(__name__)
ALERT_HEADER = "x-kvtoll-budget-alert"


class BudgetExceeded(OpenAIError):
    """429 for a request over a monthly budget (OpenAI's ``insufficient_quota`` type)."""

    def __init__(self, scope: str, limit_pico: int, spent_pico: int, period: str) -> None:
        super().__init__(
            f"Monthly budget of {scope} ({exact_usd(limit_pico)} USD for {period}) is exhausted:"
            f" {exact_usd(spent_pico)} USD spent. Requests are refused until the budget is"
            " raised or the month ends.",
            status=429, type="insufficient_quota", code="budget_exceeded",
        )


@dataclass(frozen=True)
class BudgetHold:
    """One admitted request's reservation against its budgets' counters."""

    request_id: str
    counter_keys: tuple[str, ...]
    reserved_pico: int
    alert_percent: int | None  # set when a budget's alert threshold is reached

    @property
    def alert_header(self) -> str | None:
        return None if self.alert_percent is None else f"{self.alert_percent}%"


@dataclass(frozen=True)
class _Scope:
    counter_key: str
    terms: BudgetTerms
    name: str  # for the refusal message
    labels: tuple[str, str]  # (tenant, key_id or "") of the gauges


@dataclass(frozen=True)
class _Book:
    """Budgets and prices as loaded at one refresh."""

    tenants: Mapping[int, BudgetRow] = field(default_factory=dict)
    keys: Mapping[str, BudgetRow] = field(default_factory=dict)
    prices: PriceBook = field(default_factory=PriceBook)


def _month(at: datetime) -> str:
    return f"{at.astimezone(UTC):%Y-%m}"


class BudgetGuard:
    """Holds and settles budget reservations (see module doc); start it before serving."""

    def __init__(self, factory: sessionmaker[Session], counters: SpendCounters,
                 metrics: ProxyMetrics, *, prefix: str, refresh_s: float = 5.0,
                 clock: Callable[[], datetime] = lambda: datetime.now(UTC)) -> None:
        self._factory = factory
        self._counters = counters
        self._metrics = metrics
        self._prefix = prefix
        self._refresh_s = refresh_s
        self._clock = clock
        self._book = _Book()
        self._open: dict[str, BudgetHold] = {}
        self._pending: set[asyncio.Task[None]] = set()
        self._loop: asyncio.Task[None] | None = None
        self._gauges: set[tuple[str, str]] = set()

    def _counter_key(self, row: BudgetRow, month: str) -> str:
        scope = "tenant" if row.api_key_id is None else f"key:{row.api_key_id}"
        return f"{self._prefix}{{t{row.tenant_id}}}:{month}:{scope}"  # one Redis slot a tenant

    def _scope(self, row: BudgetRow, month: str) -> _Scope:
        name = (f"tenant '{row.tenant_name}'" if row.api_key_id is None
                else f"key {row.api_key_id} of tenant '{row.tenant_name}'")
        return _Scope(self._counter_key(row, month), row.terms, name,
                      (row.tenant_name, row.api_key_id or ""))

    def _rows(self, identity: KeyIdentity) -> list[BudgetRow]:
        book = self._book
        rows = (book.tenants.get(identity.tenant_id), book.keys.get(identity.key_id))
        return [row for row in rows if row is not None]

    def applies(self, identity: KeyIdentity) -> bool:
        """Whether a budget (the tenant's or the key's own) covers ``identity``: without
        one, :meth:`hold` touches no store and returns None."""
        book = self._book
        return identity.tenant_id in book.tenants or identity.key_id in book.keys

    async def hold(self, identity: KeyIdentity, model: str, prompt_tokens: int,
                   completion_tokens: int, request_id: str, arrived_at: datetime,
                   ) -> BudgetHold | None:
        """Reserve the request's worst-case cost; :class:`BudgetExceeded` if a budget
        is spent. ``None`` when no budget applies (no store is touched then)."""
        rows = self._rows(identity)
        if not rows:
            return None
        month = _month(arrived_at)
        scopes = [self._scope(row, month) for row in rows]
        price = self._book.prices.in_force(model, arrived_at)
        worst = 0 if price is None else rate(
            Usage(prompt_tokens, 0, completion_tokens, ServedBy.ENGINE), price).list_pico
        keys = [s.counter_key for s in scopes]
        decision = await self._counters.reserve(keys, [s.terms.limit_pico for s in scopes], worst)
        for scope, spent in zip(scopes, decision.before, strict=True):
            self._gauge(scope, spent + (worst if decision.allowed else 0))
        if not decision.allowed:
            refused = scopes[decision.refused_index or 0]
            self._metrics.budget_refused.inc()
            raise BudgetExceeded(refused.name, refused.terms.limit_pico,
                                 decision.before[decision.refused_index or 0], month)
        alerts = [s.terms.percent_used(spent) for s, spent in zip(scopes, decision.before,
                                                                   strict=True)
                  if s.terms.alert_reached(spent)]
        hold = BudgetHold(request_id, tuple(keys), worst, max(alerts) if alerts else None)
        self._open[request_id] = hold
        return hold

    def settle(self, hold: BudgetHold, entry: LedgerEntry) -> None:
        """Replace the hold by what ``entry`` costs (once; later calls do nothing)."""
        price = self._book.prices.in_force(entry.model, entry.created_at)
        actual = 0 if price is None else rate(entry.usage, price).billed_pico
        self._adjust(hold, actual)

    def release(self, hold: BudgetHold) -> None:
        """The request ended without a ledger row: give its whole hold back (once)."""
        self._adjust(hold, 0)

    def _adjust(self, hold: BudgetHold, actual: int) -> None:
        if self._open.pop(hold.request_id, None) is None:
            return
        task = asyncio.get_running_loop().create_task(
            self._counters.add(hold.counter_keys, actual - hold.reserved_pico))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    def _gauge(self, scope: _Scope, spent: int) -> None:
        limit = scope.terms.limit_pico
        ratio = float("inf") if limit == 0 else spent / limit  # display only
        self._metrics.child(self._metrics.budget_used_ratio, *scope.labels).set(ratio)
        alert = 1 if scope.terms.alert_reached(spent) else 0
        self._metrics.child(self._metrics.budget_alert, *scope.labels).set(alert)
        self._gauges.add(scope.labels)

    def _load(self) -> tuple[_Book, dict[str, int], list[_Scope]]:
        """Budgets, prices and the month's ledger spend (blocking: 1 or 3 queries)."""
        now = self._clock()
        month = _month(now)
        with self._factory() as session:
            rows = list_budgets(session)
            if not rows:  # the usual case: one query, nothing to reconcile
                return _Book(), {}, []
            prices = PriceBook.load(session)
            spend = month_to_date_spend(session, now, {r.tenant_id for r in rows})
        book = _Book({r.tenant_id: r for r in rows if r.api_key_id is None},
                     {r.api_key_id: r for r in rows if r.api_key_id is not None}, prices)
        scopes = [self._scope(r, month) for r in rows]
        floors = {s.counter_key: spent_on(r, spend) for s, r in zip(scopes, rows, strict=True)}
        return book, floors, scopes

    async def refresh(self) -> None:
        """Reload budgets and prices, reconcile the counters with the ledger, then
        publish the new budgets (a new budget starts from the month's real spend)."""
        try:
            book, floors, scopes = await anyio.to_thread.run_sync(self._load)
        except Exception as exc:  # the database is down: keep what was loaded
            log.warning("budgets: cannot reload from the database (%s)", exc)
            return
        await self._counters.raise_to(floors)
        values = await self._counters.read([s.counter_key for s in scopes])
        self._book = book
        for labels in self._gauges - {s.labels for s in scopes}:  # budgets removed
            self._metrics.forget(self._metrics.budget_used_ratio, *labels)
            self._metrics.forget(self._metrics.budget_alert, *labels)
        self._gauges = set()
        for scope, value in zip(scopes, values, strict=True):
            self._gauge(scope, value)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._refresh_s)
            await self.refresh()

    async def start(self) -> None:
        """Load the budgets once (before the first request), then keep them fresh."""
        await self.refresh()
        self._loop = asyncio.get_running_loop().create_task(self._run())

    async def aclose(self) -> None:
        """Stop refreshing; finish the settlements under way; close the counters."""
        if self._loop is not None:
            self._loop.cancel()
            await asyncio.gather(self._loop, return_exceptions=True)
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
        await self._counters.aclose()
