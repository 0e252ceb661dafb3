"""Spend budgets at the gateway: the soft alert header and gauges, the hard 429
``budget_exceeded`` with nothing billed, reconciliation with the ledger at start-up,
a key's own budget, and a concurrent burst through two gateways sharing Redis and
PostgreSQL that ends at most one request over the limit.

Costs with the seeded price (input 1 USD/1M, output 2 USD/1M): the scripted upstream
reports 7 prompt tokens and 5 completion tokens, so every request bills
7e6 + 10e6 = 17e6 picodollars; the gateway reserves its worst case first (its
prompt estimate, 10 tokens for :data:`PROMPT`, plus ``max_tokens`` = 5 at 2 USD/1M:
20e6).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from sqlalchemy.orm import Session, sessionmaker

from billing.budgets import set_budget
from billing.db import make_engine, session_factory
from billing.ledger import LedgerEntry, write_usage
from billing.migrate import upgrade
from billing.models import ApiKeyId, RequestStatus, ServedBy, TenantId
from kvtoll.settings import Settings
from proxy.upstream.base import UpstreamDelta, UpstreamRejected, UpstreamRequest
from tests.proxy.helpers import (
    ADMIN,
    MODEL,
    LiveServer,
    Tenants,
    build_app,
    ledger_count,
    ledger_rows,
    seed,
    settled_rows,
    wait_until,
)
from tests.proxy.scripted import ScriptedUpstream

PROMPT = "hello world, budget test"  # 24 bytes: estimated 6 + 4 template tokens
COST = 17 * 10**6
LIMIT_USD = "0.0001"  # 100e6 picodollars
LIMIT = 100 * 10**6
BODY = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": PROMPT}]}


def _chat(client: httpx.Client, key: str) -> httpx.Response:
    return client.post("/v1/chat/completions", json=BODY,
                       headers={"Authorization": f"Bearer {key}"})


def _budget(factory: sessionmaker[Session], tenant: str, usd: str, key: str | None = None,
            alert: str | None = None) -> None:
    with factory.begin() as session:
        set_budget(session, tenant, key, usd, alert)


def test_alert_then_hard_limit_and_refusals_are_not_billed(
    settings: Settings, db: sessionmaker[Session]
) -> None:
    tenants = seed(db)
    _budget(db, "acme", LIMIT_USD, alert="0.5")
    app = build_app(settings, db, upstreams=[ScriptedUpstream()])
    with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        answers = [_chat(client, tenants.key_a) for _ in range(8)]
        metrics = client.get("/metrics", headers=ADMIN).text
        other = _chat(client, tenants.key_b)  # globex has no budget
    assert [r.status_code for r in answers] == [200] * 6 + [429] * 2
    # spend before each request: 0, 17, 34, 51, 68, 85 (e6): the alert starts at 50 %
    alerts = [r.headers.get("x-kvtoll-budget-alert") for r in answers[:6]]
    assert alerts == [None, None, None, "51%", "68%", "85%"]
    refused = answers[-1]
    error = refused.json()["error"]
    assert (error["code"], error["type"], error["param"]) == (
        "budget_exceeded", "insufficient_quota", None)
    assert "tenant 'acme'" in error["message"] and "0.0001 USD" in error["message"]
    assert refused.headers["x-should-retry"] == "false"
    assert 'kvtoll_budget_alert{key="",tenant="acme"} 1.0' in metrics
    assert 'kvtoll_budget_used_ratio{key="",tenant="acme"} 1.02' in metrics
    assert "kvtoll_budget_refused_total 2.0" in metrics
    assert other.status_code == 200 and "x-kvtoll-budget-alert" not in other.headers
    rows = settled_rows(db, 7)  # six for acme, one for globex; no row for a refusal
    assert sum(r.billed_pico for r in rows if r.tenant_id == tenants.tenant_a) == 6 * COST


def test_a_key_budget_and_spend_already_in_the_ledger(
    settings: Settings, db: sessionmaker[Session]
) -> None:
    tenants = seed(db)
    month = datetime.now(UTC)
    for _ in range(5):  # 85e6 spent this month before the gateway starts
        write_usage(db, _entry(tenants, month))
    _budget(db, "acme", "0.00009", key=tenants.key_a_id)
    _budget(db, "acme", "1")
    app = build_app(settings, db, upstreams=[ScriptedUpstream()])
    with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        first, second = _chat(client, tenants.key_a), _chat(client, tenants.key_a)
    assert first.status_code == 200 and first.headers["x-kvtoll-budget-alert"] == "94%"
    assert second.status_code == 429
    assert f"key {tenants.key_a_id} of tenant 'acme'" in second.json()["error"]["message"]
    assert ledger_count(db) == 6


def _entry(tenants: Tenants, when: datetime) -> LedgerEntry:
    return LedgerEntry(
        request_id=str(uuid.uuid4()), tenant_id=TenantId(tenants.tenant_a),
        api_key_id=ApiKeyId(tenants.key_a_id), model=MODEL, served_by=ServedBy.ENGINE,
        status=RequestStatus.OK, prompt_tokens=7, cached_tokens=0, completion_tokens=5,
        similarity=None, worker=None, created_at=when,
    )


async def _burst(urls: list[str], key: str, count: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=60) as client:
        headers = {"Authorization": f"Bearer {key}"}
        return list(await asyncio.gather(*(
            client.post(urls[i % len(urls)] + "/v1/chat/completions", json=BODY,
                        headers=headers)
            for i in range(count)
        )))


@pytest.mark.postgres
@pytest.mark.redis
def test_concurrent_burst_through_two_gateways_ends_at_most_one_request_over(
    settings: Settings, postgres_url: str, redis_url: str, redis_prefix: str, tmp_path: Path,
) -> None:
    upgrade(postgres_url)
    engine = make_engine(postgres_url)
    direct = session_factory(engine)
    tenants = seed(direct)
    _budget(direct, "acme", LIMIT_USD)
    apps = [
        build_app(
            settings.model_copy(update={"redis_url": redis_url,
                                        "data_dir": str(tmp_path / f"gw{i}")}),
            direct, upstreams=[ScriptedUpstream(upstream_name=f"up{i}", delay_s=0.01)],
            ratelimit_prefix=redis_prefix,
        )
        for i in range(2)
    ]
    with LiveServer(apps[0]) as one, LiveServer(apps[1]) as two:
        answers = [r for _ in range(2)
                   for r in asyncio.run(_burst([one.url, two.url], tenants.key_a, 30))]
        with httpx.Client(base_url=two.url, timeout=30) as client:
            for _ in range(3):  # the budget is spent: at most a settlement away from a 429
                answers.append(_chat(client, tenants.key_a))
                if answers[-1].status_code == 429:
                    break
    codes = [r.status_code for r in answers]
    assert set(codes) == {200, 429} and codes[-1] == 429, codes
    assert all(r.json()["error"]["code"] == "budget_exceeded"
               for r in answers if r.status_code == 429)
    rows = settled_rows(direct, codes.count(200))  # refusals wrote nothing
    engine.dispose()
    spent = sum(r.billed_pico for r in rows)
    assert LIMIT <= spent < LIMIT + max(r.billed_pico for r in rows)


class _Rejecting(ScriptedUpstream):
    """An upstream that refuses every request as invalid (a 4xx, no ledger row)."""

    async def _stream(self, request: UpstreamRequest) -> AsyncIterator[UpstreamDelta]:
        raise UpstreamRejected("the upstream does not like this prompt", param="messages")
        yield UpstreamDelta(index=0, text="", finish_reason=None)  # pragma: no cover


def test_holds_of_requests_that_bill_nothing_are_given_back(
    settings: Settings, db: sessionmaker[Session]
) -> None:
    """Each request holds 20e6 of a 40e6 budget while it runs: were the holds of failed
    requests kept, the third request would be refused for the budget."""
    tenants = seed(db)
    _budget(db, "acme", "0.00004")
    for upstream, status in ((_Rejecting(), 400), (ScriptedUpstream(fail_before_first=True), 502)):
        app = build_app(settings, db, upstreams=[upstream])
        with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as client:
            codes = [_chat(client, tenants.key_a).status_code for _ in range(4)]
        assert codes == [status] * 4
    assert all(r.billed_pico == 0 for r in ledger_rows(db))  # the 502s: zero rows


def _codes(answers: list[httpx.Response]) -> list[tuple[int, str | None]]:
    return [(r.status_code, r.json()["error"]["code"] if r.status_code != 200 else None)
            for r in answers]


def test_a_budget_refusal_hands_the_rate_limit_charge_back(
    settings: Settings, db: sessionmaker[Session]
) -> None:
    """The rate limit and the budget hold are checked together. 12 requests a minute
    hold 2 at once (10 s of burst): had the two budget refusals kept their rate-limit
    charge, the third request would be refused for its rate, not its budget."""
    tenants = seed(db, rpm=12)
    _budget(db, "acme", "0.000015")  # spent 17e6 after the first request: over
    app = build_app(settings, db, upstreams=[ScriptedUpstream()])
    with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        answers = [_chat(client, tenants.key_a) for _ in range(3)]
    assert _codes(answers) == [(200, None), (429, "budget_exceeded"), (429, "budget_exceeded")]


@pytest.mark.redis
def test_a_rate_limit_refusal_gives_its_budget_hold_back(
    settings: Settings, db: sessionmaker[Session], redis_url: str, redis_prefix: str,
) -> None:
    """Rate limit and budget counters in Redis, checked together: the holds of the two
    requests the rate limit refused (6 a minute: one at once) are given back, so the
    tenant's counter ends at the one answered request's cost."""
    import redis

    tenants = seed(db, rpm=6)
    _budget(db, "acme", "1")
    app = build_app(settings.model_copy(update={"redis_url": redis_url}), db,
                    upstreams=[ScriptedUpstream()], ratelimit_prefix=redis_prefix)
    with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        answers = [_chat(client, tenants.key_a) for _ in range(3)]
        assert _codes(answers) == [(200, None), (429, "rate_limit_exceeded"),
                                   (429, "rate_limit_exceeded")]
        counter = (f"{redis_prefix}budget:{{t{tenants.tenant_a}}}:"
                   f"{datetime.now(UTC):%Y-%m}:tenant")
        store = redis.Redis.from_url(redis_url)
        wait_until(lambda: int(store.get(counter) or 0) == COST,
                   f"the budget counter at {COST} (it is {store.get(counter)!r})")
        store.close()
    assert ledger_count(db) == 1
