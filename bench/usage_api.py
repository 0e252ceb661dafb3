"""Usage API latency over 1,000,000 ledger rows in PostgreSQL.

Creates a dedicated database (dropped at the end), migrates it, loads the ledger
with COPY, then times ``GET /v1/organization/usage/completions`` for one month at
day granularity through the real HTTP route (httpx ASGI transport, bearer key),
for the busiest tenant. Peers in the same run: the bare SQL aggregate (the floor
the route cannot beat) and a naive "fetch the rows, add them up in Python" loop.
The route keeps an exact per-bucket cache (``billing.usage_cache``): the first
call aggregates every row, later calls only count rows per day (index-only) and
aggregate again the days that changed; a late row is written to show that case.
Prints one JSON object. Goal: p50 and p99 <= 200 ms.

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
from billing.migrate import upgrade
from billing.pricing import set_price
from billing.usage import BucketWidth, UsageQuery, aggregate_usage, build_statement
from proxy.settings import load_settings
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


def _load(url: str, layout: list, count: int) -> float:
    """COPY ``count`` rows; returns seconds taken (VACUUM ANALYZE included)."""
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
    engine.dispose()
    return time.perf_counter() - began


async def _time_route(
    app: Any, key: str, params: dict, repeats: int,
    path: str = "/v1/organization/usage/completions",
) -> list[float]:
    """Latency of every call in ms; the first call finds the bucket cache cold."""
    transport = httpx.ASGITransport(app=app)
    headers = {"Authorization": f"Bearer {key}"}
    samples = []
    async with httpx.AsyncClient(transport=transport, base_url="http://bench") as client:
        for _ in range(repeats):
            began = time.perf_counter()
            response = await client.get(path, params=params, headers=headers)
            elapsed = time.perf_counter() - began
            response.raise_for_status()
            samples.append(elapsed * 1000)
    return samples


def _late_row(url: str, layout: list) -> None:
    """One late ledger row inside the measured month (its day must be aggregated again)."""
    engine = make_engine(url)
    row = next(_rows(layout[:1], 1, random.Random(2)))
    values = (*row[:9], MONTH[0] + timedelta(days=3), datetime.now(UTC), *row[11:])
    raw = engine.raw_connection()
    try:
        cursor = raw.cursor()
        with cursor.copy(f"COPY usage_ledger ({COLUMNS}) FROM STDIN") as copy:
            copy.write_row(values)
        raw.commit()
    finally:
        raw.close()
        engine.dispose()


def _time_sql(factory: sessionmaker[Session], tenant_id: int, repeats: int) -> list[float]:
    query = UsageQuery(MONTH[0], MONTH[1], tenant_id, width=BucketWidth.DAY)
    samples = []
    with factory() as session:
        for _ in range(repeats):
            began = time.perf_counter()
            aggregate_usage(session, query)
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
    }


def run(base_url: str, rows: int, tenants: int, repeats: int) -> dict[str, Any]:
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
        load_s = _load(url, layout, rows)
        busiest = layout[0][0]
        with factory() as session:
            month_rows = session.execute(
                text("SELECT count(*) FROM usage_ledger WHERE tenant_id = :t"
                     " AND created_at >= :a AND created_at < :b"),
                {"t": busiest, "a": MONTH[0], "b": MONTH[1]},
            ).scalar_one()
        settings = load_settings(secret="bench-secret", admin_token=ADMIN_TOKEN)
        app = create_web_app(settings, factory)
        params = {"start_time": int(MONTH[0].timestamp()), "end_time": int(MONTH[1].timestamp()),
                  "bucket_width": "1d", "limit": 31}
        route = asyncio.run(_time_route(app, key, params, repeats + 1))
        grouped = asyncio.run(_time_route(app, key, {**params, "group_by": "model"}, repeats + 1))
        admin_route = asyncio.run(_time_route(
            app, ADMIN_TOKEN, params, 5, "/admin/v1/organization/usage/completions"
        ))
        _late_row(url, layout)
        after_late = asyncio.run(_time_route(app, key, params, 1))
        result = {
            "bench": "usage_api",
            "ledger_rows": rows,
            "tenants": tenants,
            "busiest_tenant_rows_in_month": month_rows,
            "load_seconds": round(load_s, 1),
            "route_month_by_day_cold_cache_ms": round(route[0], 1),
            "route_month_by_day": _summary(route[1:]),
            "route_month_by_day_group_by_model_cold_cache_ms": round(grouped[0], 1),
            "route_month_by_day_group_by_model": _summary(grouped[1:]),
            "route_after_one_late_row_ms": round(after_late[0], 1),
            "admin_route_all_tenants_month_by_day": _summary(admin_route),
            "peer_sql_aggregate_only": _summary(_time_sql(factory, busiest, repeats)),
            "peer_naive_python_aggregation_ms": round(_time_naive(factory, busiest), 1),
            "plan": _plan(factory, busiest),
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
    args = parser.parse_args()
    print(json.dumps(run(args.database_url, args.rows, args.tenants, args.repeats), indent=2))


if __name__ == "__main__":
    main()
