"""The ledger writer process: batches leave the outbox only once the child committed
them; a child that dies or a database that fails keeps them; never a row twice."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import httpx
import pytest
from sqlalchemy.orm import Session, sessionmaker

from billing.db import make_engine, session_factory
from kvtoll.settings import Settings
from proxy import ledger_process
from proxy.ledger_process import LedgerProcessError, ProcessLedgerSink, shareable_url
from proxy.metering import InProcessLedgerSink, Meter, entry_to_json
from proxy.metrics import ProxyMetrics
from proxy.outbox import Outbox
from tests.proxy.helpers import (
    MODEL,
    LiveServer,
    Tenants,
    build_app,
    ledger_entry,
    ledger_rows,
    wait_until,
)
from tests.proxy.scripted import ScriptedUpstream


def _sink(db: sessionmaker[Session]) -> ProcessLedgerSink:
    url = shareable_url(db)
    assert url is not None
    return ProcessLedgerSink(url)


def test_shareable_url_only_for_databases_another_process_can_open(tmp_path: Path) -> None:
    memory = session_factory(make_engine("sqlite://"))
    assert shareable_url(memory) is None
    assert shareable_url(sessionmaker()) is None
    on_disk = session_factory(make_engine(f"sqlite:///{tmp_path}/x.db"))
    assert shareable_url(on_disk) == f"sqlite:///{tmp_path}/x.db"


def test_rows_are_written_by_another_process_exactly_once(
    tmp_path: Path, db: sessionmaker[Session], tenants: Tenants
) -> None:
    sink = _sink(db)
    entries = [ledger_entry(tenants) for _ in range(5)]

    async def scenario() -> None:
        meter = Meter(db, Outbox.in_dir(tmp_path), ProxyMetrics.create(), sink=sink)
        for entry in entries:
            await meter.record(entry)
        assert await meter.drain() == 5
        assert sink.pid is not None and sink.pid != os.getpid()
        await meter.record(entries[0])  # a retry of a recorded request: no second row
        assert await meter.drain() == 1
        await meter.close()
        assert sink.pid is None

    try:
        asyncio.run(scenario())
    finally:
        sink.close()
    rows = ledger_rows(db)
    assert sorted(r.request_id for r in rows) == sorted(e.request_id for e in entries)


def test_invalid_entry_is_isolated_by_the_child(
    tmp_path: Path, db: sessionmaker[Session], tenants: Tenants
) -> None:
    sink = _sink(db)
    good, bad = ledger_entry(tenants), ledger_entry(tenants, cached_tokens=50)  # cached > prompt
    try:
        with pytest.raises(ValueError):
            sink.write([entry_to_json(bad)])

        async def scenario() -> None:
            meter = Meter(db, Outbox.in_dir(tmp_path), ProxyMetrics.create(), sink=sink)
            await meter.record(bad)
            await meter.record(good)
            assert await meter.drain() == 2  # both left the outbox; only one row

        asyncio.run(scenario())
    finally:
        sink.close()
    assert [r.request_id for r in ledger_rows(db)] == [good.request_id]


def test_a_killed_child_is_replaced_and_nothing_is_written_twice(
    tmp_path: Path, db: sessionmaker[Session], tenants: Tenants
) -> None:
    sink = _sink(db)
    metrics = ProxyMetrics.create()
    first, later = ledger_entry(tenants), [ledger_entry(tenants) for _ in range(3)]

    async def scenario() -> None:
        meter = Meter(db, Outbox.in_dir(tmp_path), metrics, sink=sink, retry_interval_s=0.0)
        await meter.record(first)
        assert await meter.drain() == 1
        pid = sink.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        while sink.pid is not None:  # until the sink sees it gone
            await asyncio.sleep(0.01)
        for entry in later:
            await meter.record(entry)
        assert await meter.drain() == 3  # a fresh child is started for the trip
        assert sink.pid not in (None, pid)
        assert metrics.registry.get_sample_value("kvtoll_outbox_depth") == 0.0
        await meter.close()

    try:
        asyncio.run(scenario())
    finally:
        sink.close()
    rows = ledger_rows(db)
    assert sorted(r.request_id for r in rows) == sorted(e.request_id for e in [first, *later])


def test_database_failure_in_the_child_keeps_entries(
    tmp_path: Path, db: sessionmaker[Session], tenants: Tenants
) -> None:
    broken = ProcessLedgerSink(f"sqlite:///{tmp_path}/missing/dir/x.db")
    metrics = ProxyMetrics.create()
    entries = [ledger_entry(tenants) for _ in range(3)]
    try:
        with pytest.raises(LedgerProcessError):
            broken.write([entry_to_json(entries[0])])

        async def scenario() -> None:
            down = Meter(db, Outbox.in_dir(tmp_path / "box"), metrics, sink=broken,
                         retry_interval_s=0.0)
            for entry in entries:
                await down.record(entry)
            assert await down.drain() == 0
            assert metrics.registry.get_sample_value("kvtoll_outbox_depth") == 3.0
            await down.close()
            up = Meter(db, Outbox.in_dir(tmp_path / "box"), metrics, sink=_sink(db))
            assert await up.drain() == 3
            await up.close()

        asyncio.run(scenario())
    finally:
        broken.close()
    assert len(ledger_rows(db)) == 3


def test_a_child_that_cannot_start_hands_over_to_the_fallback(
    tmp_path: Path, db: sessionmaker[Session], tenants: Tenants,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = shareable_url(db)
    assert url is not None
    sink = ProcessLedgerSink(url, fallback=InProcessLedgerSink(db))
    monkeypatch.setattr(ledger_process.sys, "executable", "/bin/false")  # dies at once
    entry = ledger_entry(tenants)
    for _ in range(ledger_process.MAX_DEATHS):
        with pytest.raises(LedgerProcessError):
            sink.write([entry_to_json(entry)])
    assert ledger_rows(db) == []
    assert sink.write([entry_to_json(entry)]) == 1  # in-process now
    assert [r.request_id for r in ledger_rows(db)] == [entry.request_id]
    sink.close()


def test_gateway_answers_with_rows_written_by_its_writer_process(
    settings: Settings, db: sessionmaker[Session], tenants: Tenants
) -> None:
    app = build_app(settings, db, upstreams=[ScriptedUpstream()])
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    headers = {"Authorization": f"Bearer {tenants.key_a}"}
    with LiveServer(app) as server:
        ids = [httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers,
                          timeout=30).headers["x-kvtoll-request-id"] for _ in range(3)]
        wait_until(lambda: len(ledger_rows(db)) == 3, "ledger rows")
        sink = app.state.kvtoll.meter._sink
        assert isinstance(sink, ProcessLedgerSink)
        assert sink.pid is not None and sink.pid != os.getpid()
    assert sink.pid is None  # stopped with the gateway
    assert sorted(r.request_id for r in ledger_rows(db)) == sorted(ids)


def test_thread_writer_setting_keeps_the_ledger_in_process(
    settings: Settings, db: sessionmaker[Session]
) -> None:
    threaded = build_app(settings.model_copy(update={"ledger_writer": "thread"}), db,
                         upstreams=[ScriptedUpstream()])
    assert isinstance(threaded.state.kvtoll.meter._sink, InProcessLedgerSink)
    default = build_app(settings, db, upstreams=[ScriptedUpstream()])
    assert isinstance(default.state.kvtoll.meter._sink, ProcessLedgerSink)
