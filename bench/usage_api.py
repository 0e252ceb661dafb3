"""Usage API latency over 1,000,000 ledger rows in PostgreSQL.

Creates a dedicated database (dropped at the end), migrates it, loads the ledger
with COPY and builds the hourly rollup from it with one ``INSERT ... SELECT``
(:func:`billing.usage_rollup.rebuild_rollup`), then times
``GET /v1/organization/usage/completions`` for one month at day granularity
through the real HTTP route (httpx ASGI transport, bearer key), for the busiest
tenant: cold (the first call of a freshly started app with a fresh connection
pool, several starts) and warm. The route reads the rollup, so cold and warm
differ only by connection set-up. Peers in the same run: the same aggregate
straight on the ledger (what the route cost before the rollup), and a naive
"fetch the rows, add them up in Python" loop. A late row written through
:func:`billing.ledger.write_usage` must show up in the next answer; the cost of
keeping the rollup is shown as write latency with and without it.
Prints one JSON object. Goal: cold p50 and p99 <= 200 ms.

    .venv/bin/python bench/usage_api.py [--rows 1000000] [--repeats 40]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from billing.accounts import create_key, create_tenant
from billing.db import make_engine, session_factory
from billing.ledger import (
    LedgerEntry,
    _insert_many_ignoring_duplicates,
    _row_values,
    write_usage,
)
from billing.migrate import upgrade
from billing.models import ApiKeyId, RequestStatus, ServedBy, TenantId
from billing.pricing import set_price
from billing.usage import BucketWidth, UsageQuery, aggregate_usage, build_statement
from billing.usage_rollup import rebuild_rollup
from kvtoll.settings import load_settings
from web.app import create_web_app

START = datetime(2026, 1, 1, tzinfo=UTC)
DAYS = 90
MONTH = (datetime(2026, 2, 1, tzinfo=UTC), datetime(2026, 3, 1, tzinfo=UTC))
ADMIN_TOKEN = "bench-admin-token-0123456789"
MODELS = ("smollm2-135m", "big-model", "mid-model")
COLUMNS = (
    "request_id, tenant_id, api_key_id, model, served_by, status, prompt_tokens, cached_tokens,"
    " completion_tokens, created_at, recorded_at, billed_pico, list_pico"
)


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _seed_accounts(factory: sessionmaker[Session], tenants: int) -> tuple[list, str]:
    """Tenants with two keys each; returns [(tenant_id, [key_ids])] and the busiest key."""
    layout, busiest_key = [], ""
    with factory.begin() as session:
        for model in MODELS:
            set_price(session, model, "1", "0.5", "4", "0.1", effective_from=START)
        for i in range(tenants):
            tenant = create_tenant(session, f"bench-{i}")
            keys = [create_key(session, tenant.name, f"k{j}") for j in range(2)]
            layout.append((tenant.id, [row.id for row, _ in keys]))
            if i == 0:
                busiest_key = keys[0][1]
    return layout, busiest_key


def _rows(layout: list, count: int, rng: random.Random) -> Iterator[tuple[Any, ...]]:
    """Half the rows belong to tenant 0 (the busiest); the rest spread evenly.

    Rows come in arrival order, as the proxy appends them to the ledger.
    """
    span = DAYS * 86400
    offsets = sorted(rng.randrange(span) for _ in range(count))
    for offset in offsets:
        tenant_id, key_ids = layout[0] if rng.random() < 0.5 else rng.choice(layout)
        prompt = rng.randint(1, 4000)
        semantic = rng.random() < 0.2
        cached = 0 if semantic else rng.randint(0, prompt)
        completion = rng.randint(0, 600)
        listed = prompt * 10**6 + completion * 4 * 10**6
        billed = listed // 10 if semantic else listed - cached * 5 * 10**5
        created = START + timedelta(seconds=offset)
        yield (
            str(uuid.uuid4()), tenant_id, rng.choice(key_ids), rng.choice(MODELS),
            "semantic" if semantic else "engine", "ok", prompt, cached, completion,
            created, created, billed, listed,
        )


def _load(url: str, layout: list, count: int) -> tuple[float, float]:
    """COPY ``count`` ledger rows, then build the rollup; seconds for each (ANALYZE included)."""
    engine = make_engine(url)
    began = time.perf_counter()
    raw = engine.raw_connection()
    try:
        cursor = raw.cursor()
        with cursor.copy(f"COPY usage_ledger ({COLUMNS}) FROM STDIN") as copy:
            for row in _rows(layout, count, random.Random(1)):
                copy.write_row(row)
        raw.commit()
    finally:
        raw.close()
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE usage_ledger"))
    copied = time.perf_counter()
    with session_factory(engine).begin() as session:
        rebuild_rollup(session)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE usage_hourly"))
    engine.dispose()
    return copied - began, time.perf_counter() - copied


async def _time_route(
    app: Any, key: str, params: dict, repeats: int,
    path: str = "/v1/organization/usage/completions",
) -> tuple[list[float], dict]:
    """Latency of every call in ms, and the last answer."""
    transport = httpx.ASGITransport(app=app)
    headers = {"Authorization": f"Bearer {key}"}
    samples, body = [], {}
    async with httpx.AsyncClient(transport=transport, base_url="http://bench") as client:
        for _ in range(repeats):
            began = time.perf_counter()
            response = await client.get(path, params=params, headers=headers)
            elapsed = time.perf_counter() - began
            response.raise_for_status()
            samples.append(elapsed * 1000)
            body = response.json()
    return samples, body


def _cold_route(url: str, key: str, params: dict, starts: int) -> list[float]:
    """The first call of a freshly started app (new engine, empty pool), ``starts`` times."""
    samples = []
    settings = load_settings(secret="bench-secret", admin_token=ADMIN_TOKEN)
    for _ in range(starts):
        engine = make_engine(url)
        app = create_web_app(settings, session_factory(engine))
        samples += asyncio.run(_time_route(app, key, params, 1))[0]
        engine.dispose()
    return samples


def _requests_in(body: dict) -> int:
    return sum(r["num_model_requests"] for b in body["data"] for r in b["results"])


def _bench_entry(tenant_id: int, key_id: str, when: datetime) -> LedgerEntry:
    return LedgerEntry(
        request_id=str(uuid.uuid4()), tenant_id=TenantId(tenant_id),
        api_key_id=ApiKeyId(key_id), model=MODELS[0], served_by=ServedBy.ENGINE,
        status=RequestStatus.OK, prompt_tokens=100, cached_tokens=40, completion_tokens=20,
        similarity=None, worker="w0", created_at=when,
    )


def _time_writes(factory: sessionmaker[Session], layout: list, count: int) -> dict[str, Any]:
    """``write_usage`` (ledger + rollup) against the bare ledger insert, same entries."""
    tenant_id, key_ids = layout[0]
    when = MONTH[1] + timedelta(days=2)  # outside the measured month
    with_rollup, ledger_only = [], []
    for _ in range(count):
        began = time.perf_counter()
        write_usage(factory, _bench_entry(tenant_id, key_ids[0], when))
        with_rollup.append((time.perf_counter() - began) * 1000)
        began = time.perf_counter()
        with factory.begin() as session:
            values = _row_values(session, _bench_entry(tenant_id, key_ids[0], when))
            _insert_many_ignoring_duplicates(session, [values])
        ledger_only.append((time.perf_counter() - began) * 1000)
    return {"write_usage_with_rollup": _summary(with_rollup),
            "peer_ledger_insert_only": _summary(ledger_only)}


def _time_sql(
    factory: sessionmaker[Session], tenant_id: int, repeats: int, from_ledger: bool
) -> list[float]:
    query = UsageQuery(MONTH[0], MONTH[1], tenant_id, width=BucketWidth.DAY)
    samples = []
    with factory() as session:
        for _ in range(repeats):
            began = time.perf_counter()
            aggregate_usage(session, query, from_ledger=from_ledger)
            samples.append((time.perf_counter() - began) * 1000)
    return samples


def _time_naive(factory: sessionmaker[Session], tenant_id: int) -> float:
    """Peer: fetch every row of the month and add up per day in Python."""
    sql = text(
        "SELECT created_at, prompt_tokens, cached_tokens, completion_tokens FROM usage_ledger"
        " WHERE tenant_id = :t AND created_at >= :a AND created_at < :b"
    )
    began = time.perf_counter()
    days: dict[Any, list[int]] = {}
    with factory() as session:
        for created, prompt, cached, completion in session.execute(
            sql, {"t": tenant_id, "a": MONTH[0], "b": MONTH[1]}
        ):
            acc = days.setdefault(created.date(), [0, 0, 0, 0])
            acc[0] += 1
            acc[1] += prompt
            acc[2] += cached
            acc[3] += completion
    return (time.perf_counter() - began) * 1000


def _plan(factory: sessionmaker[Session], tenant_id: int) -> str:
    query = UsageQuery(MONTH[0], MONTH[1], tenant_id, width=BucketWidth.DAY)
    stmt = build_statement(query, "postgresql")
    with factory() as session:
        compiled = stmt.compile(session.get_bind(), compile_kwargs={"literal_binds": True})
        lines = session.execute(text(f"EXPLAIN {compiled}")).scalars().all()
    return " | ".join(line.strip() for line in lines if "Scan" in line)


def _summary(samples: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(statistics.median(samples), 1),
        "p99_ms": round(_percentile(samples, 0.99), 1),
        "min_ms": round(min(samples), 1),
        "n": len(samples),
    }


def _count(factory: sessionmaker[Session], table: str, tenant_id: int | None = None) -> int:
    where = "" if tenant_id is None else (
        " WHERE tenant_id = :t AND created_at >= :a AND created_at < :b")
    with factory() as session:
        return int(session.execute(
            text(f"SELECT count(*) FROM {table}{where}"),
            {"t": tenant_id, "a": MONTH[0], "b": MONTH[1]},
        ).scalar_one())


def _measure(url: str, factory: sessionmaker[Session], layout: list, key: str,
             repeats: int, cold_starts: int) -> dict[str, Any]:
    busiest = layout[0][0]
    params = {"start_time": int(MONTH[0].timestamp()), "end_time": int(MONTH[1].timestamp()),
              "bucket_width": "1d", "limit": 31}
    cold = _cold_route(url, key, params, cold_starts)
    app = create_web_app(load_settings(secret="bench-secret", admin_token=ADMIN_TOKEN), factory)
    warm, body = asyncio.run(_time_route(app, key, params, repeats))
    grouped, _ = asyncio.run(_time_route(app, key, {**params, "group_by": "model"}, repeats))
    admin_route, _ = asyncio.run(_time_route(
        app, ADMIN_TOKEN, params, 5, "/admin/v1/organization/usage/completions"
    ))
    month_rows = _count(factory, "usage_ledger", busiest)
    write_usage(factory, _bench_entry(busiest, layout[0][1][0], MONTH[0] + timedelta(days=3)))
    after_late, late_body = asyncio.run(_time_route(app, key, params, 1))
    return {
        "busiest_tenant_rows_in_month": month_rows,
        "route_month_by_day_cold": _summary(cold),
        "route_month_by_day_warm": _summary(warm),
        "route_month_by_day_group_by_model_warm": _summary(grouped),
        "admin_route_all_tenants_month_by_day": _summary(admin_route),
        "route_requests_equal_ledger_rows": _requests_in(body) == month_rows,
        "route_after_one_late_row_ms": round(after_late[0], 1),
        "late_row_counted": _requests_in(late_body) == month_rows + 1,
        "sql_aggregate_from_rollup": _summary(_time_sql(factory, busiest, repeats, False)),
        "peer_sql_aggregate_straight_on_ledger": _summary(
            _time_sql(factory, busiest, max(5, repeats // 4), True)),
        "peer_naive_python_aggregation_ms": round(_time_naive(factory, busiest), 1),
        "plan": _plan(factory, busiest),
        **_time_writes(factory, layout, 50),
    }


def run(base_url: str, rows: int, tenants: int, repeats: int, cold_starts: int) -> dict[str, Any]:
    name = f"kvtoll_bench_{uuid.uuid4().hex[:10]}"
    admin = create_engine(make_url(base_url), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(base_url).set(database=name).render_as_string(hide_password=False)
    try:
        upgrade(url)
        engine = make_engine(url)
        factory = session_factory(engine)
        layout, key = _seed_accounts(factory, tenants)
        copy_s, rollup_s = _load(url, layout, rows)
        result = {
            "bench": "usage_api",
            "ledger_rows": rows,
            "rollup_rows": _count(factory, "usage_hourly"),
            "tenants": tenants,
            "load_copy_seconds": round(copy_s, 1),
            "build_rollup_seconds": round(rollup_s, 1),
            **_measure(url, factory, layout, key, repeats, cold_starts),
            "goal_ms": 200,
            "load_average_1m": round(os.getloadavg()[0], 2),
            "cpu_count": os.cpu_count(),
        }
        engine.dispose()
        return result
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database-url", default=os.environ.get(
        "KVTOLL_TEST_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"))
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--tenants", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--cold-starts", type=int, default=10)
    args = parser.parse_args()
    result = run(args.database_url, args.rows, args.tenants, args.repeats, args.cold_starts)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
