"""Metering through the outbox: durable before the ledger, drained once, idempotent."""

from __future__ import annotations

import asyncio
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from billing.db import make_engine, session_factory
from billing.models import ServedBy
from proxy.metering import Meter, entry_from_json, entry_to_json
from proxy.metrics import ProxyMetrics
from proxy.outbox import Outbox
from tests.proxy.helpers import Tenants, ledger_entry, ledger_rows


def test_json_round_trip(tenants: Tenants) -> None:
    entry = ledger_entry(tenants, served_by=ServedBy.SEMANTIC, similarity=0.93)
    assert entry_from_json(entry_to_json(entry)) == entry


def test_outbox_survives_reopen_and_ignores_duplicates(tmp_path: Path) -> None:
    outbox = Outbox.in_dir(tmp_path)
    outbox.put("a", {"n": 1})
    outbox.put("a", {"n": 2})
    outbox.put("b", {"n": 3})
    outbox.close()
    reopened = Outbox.in_dir(tmp_path)
    assert reopened.peek() == [("a", {"n": 1}), ("b", {"n": 3})]
    reopened.remove(["a"])
    assert reopened.depth() == 1


def test_drain_writes_once_and_keeps_entries_while_db_is_down(
    tmp_path: Path, db: sessionmaker[Session], tenants: Tenants
) -> None:
    metrics = ProxyMetrics.create()
    broken = session_factory(make_engine(f"sqlite:///{tmp_path}/missing/dir/x.db"))
    entries = [ledger_entry(tenants) for _ in range(3)]

    async def scenario() -> None:
        down = Meter(broken, Outbox.in_dir(tmp_path / "box"), metrics, retry_interval_s=0.0)
        for entry in entries:
            await down.record(entry)
        assert await down.drain() == 0
        failures = metrics.registry.get_sample_value("kvtoll_ledger_write_failures_total")
        assert failures == 1.0
        assert metrics.registry.get_sample_value("kvtoll_outbox_depth") == 3.0
        up = Meter(db, Outbox.in_dir(tmp_path / "box"), metrics)  # "restart", DB back
        await up.record(entries[0])  # a duplicate of a queued entry: still one row
        assert await up.drain() == 3
        assert await up.drain() == 0

    asyncio.run(scenario())
    rows = ledger_rows(db)
    assert sorted(r.request_id for r in rows) == sorted(e.request_id for e in entries)
    assert metrics.registry.get_sample_value("kvtoll_outbox_depth") == 0.0


def test_invalid_entry_does_not_block_the_queue(
    tmp_path: Path, db: sessionmaker[Session], tenants: Tenants
) -> None:
    good = ledger_entry(tenants)
    bad = ledger_entry(tenants, cached_tokens=50)  # more cached than prompt tokens: impossible

    async def scenario() -> None:
        meter = Meter(db, Outbox.in_dir(tmp_path), ProxyMetrics.create())
        await meter.record(bad)
        await meter.record(good)
        assert await meter.drain() == 2

    asyncio.run(scenario())
    assert [r.request_id for r in ledger_rows(db)] == [good.request_id]
