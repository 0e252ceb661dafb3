"""Metering: exactly one ledger row per accepted request, durable before the response.

Write path (transactional outbox)::

    request finishes ─► Meter.record(entry) ─► outbox.put (one append to a local journal,
                                               in the event loop; survives kill -9)
                                            └► wake the drainer
    drainer (background) ─► outbox.take_fresh() ─► LedgerSink.write ─► LedgerWriter.write
                            (records since the       (one transaction per batch,
                             last trip, no backlog)   idempotent by request id; in the
                                                      writer process of
                                                      proxy.ledger_process by default,
                                                      off the gateway's GIL)
                                                   ─► outbox.settle_taken()
                            backlog (DB was down, a crash): outbox.peek(batch) ─► write
                                                   ─► outbox.remove(batch)

The response is sent only after :meth:`Meter.record` returned, so every answered
request has its usage on disk even if the process dies the next instant; the
ledger row follows within milliseconds while the database is up. If the database
is unreachable, entries simply stay in the outbox and the drainer retries every
``retry_interval_s`` (also at startup, for entries a crashed process left). A
drain that dies between the ledger commit and the outbox delete is repeated, and
the ledger's unique request id turns the repeat into a no-op: nothing lost, nothing
billed twice. An entry the ledger refuses as invalid (a bug, never expected) is
logged with its full content and dropped so it cannot block the queue.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sqlite3
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any, Protocol

import anyio
from sqlalchemy.orm import Session, sessionmaker

from billing.ledger import LedgerEntry, LedgerWriter, write_usage
from billing.models import ApiKeyId, RequestStatus, ServedBy, TenantId
from proxy.metrics import ProxyMetrics
from proxy.outbox import Outbox

log = logging.getLogger(__name__)
DRAIN_BATCH = 200


_ENTRY_FIELDS = tuple(f.name for f in dataclasses.fields(LedgerEntry))


def entry_to_json(entry: LedgerEntry) -> dict[str, Any]:
    """A JSON-safe dict of ``entry`` (enums by value, times in ISO 8601 with offset)."""
    data = {name: getattr(entry, name) for name in _ENTRY_FIELDS}  # flat: no copy
    data["created_at"] = entry.created_at.isoformat()
    data["served_by"] = ServedBy(entry.served_by).value
    data["status"] = RequestStatus(entry.status).value
    return data


def entry_from_json(data: dict[str, Any]) -> LedgerEntry:
    """Inverse of :func:`entry_to_json`."""
    fields = dict(data)
    fields["created_at"] = datetime.fromisoformat(fields["created_at"])
    fields["served_by"] = ServedBy(fields["served_by"])
    fields["status"] = RequestStatus(fields["status"])
    fields["tenant_id"] = TenantId(fields["tenant_id"])
    key = fields.get("api_key_id")
    fields["api_key_id"] = None if key is None else ApiKeyId(key)
    return LedgerEntry(**fields)


class LedgerSink(Protocol):
    """Where the drainer's batches go: :class:`InProcessLedgerSink`, or the writer
    process of :mod:`proxy.ledger_process` (the gateway's default)."""

    def write(self, payloads: list[dict[str, Any]]) -> int:
        """Write :func:`entry_to_json` records in one ledger transaction (idempotent by
        request id); how many were new. ``ValueError`` / ``TypeError`` / ``KeyError``:
        an entry the ledger refuses; any other exception: the database failed."""
        ...

    def close(self) -> None: ...


class InProcessLedgerSink:
    """:class:`LedgerSink` in the calling thread (tests, in-memory databases)."""

    def __init__(self, factory: sessionmaker[Session]) -> None:
        self._writer = LedgerWriter(factory)

    def write(self, payloads: list[dict[str, Any]]) -> int:
        return self._writer.write([entry_from_json(p) for p in payloads])

    def close(self) -> None:
        pass


class Meter:
    """Durable usage recording through the outbox (see module doc). ``sink`` writes the
    drained batches (default: in the drainer's thread)."""

    def __init__(
        self,
        factory: sessionmaker[Session],
        outbox: Outbox,
        metrics: ProxyMetrics,
        *,
        retry_interval_s: float = 2.0,
        batch_delay_s: float = 0.02,
        clock: Callable[[], float] = time.monotonic,
        sink: LedgerSink | None = None,
    ) -> None:
        self._factory = factory
        self._sink = sink or InProcessLedgerSink(factory)
        self._outbox = outbox
        self._metrics = metrics
        self._retry_s = retry_interval_s
        self._batch_delay_s = batch_delay_s
        self._clock = clock
        self._db_down_until = 0.0
        self._drain_lock = asyncio.Lock()
        self._wake = asyncio.Event()

    @property
    def db_suspected_down(self) -> bool:
        return self._clock() < self._db_down_until

    async def record(self, entry: LedgerEntry) -> None:
        """Make ``entry`` durable (outbox) and schedule its ledger write; returns once it
        is safe to answer the client."""
        if not self.record_nowait(entry):
            await self.record_directly(entry)

    def record_nowait(self, entry: LedgerEntry) -> bool:
        """:meth:`record` without waiting: True once ``entry`` is in the outbox; False if
        the outbox could not be written (local disk trouble): then the caller must
        :meth:`record_directly`."""
        try:
            self._outbox.put(entry.request_id, entry_to_json(entry))
        except (OSError, sqlite3.Error):
            log.exception("outbox write failed; writing %s to the ledger directly",
                          entry.request_id)
            return False
        self._metrics.outbox_depth.inc()
        self._wake.set()
        return True

    async def record_directly(self, entry: LedgerEntry) -> None:
        """Write ``entry`` to the ledger now (in a worker thread), bypassing the outbox."""
        await anyio.to_thread.run_sync(write_usage, self._factory, entry)

    async def drain(self) -> int:
        """Move outbox entries into the ledger until it is empty or the database fails;
        returns how many were moved."""
        async with self._drain_lock:
            moved, depth = await anyio.to_thread.run_sync(self._drain_blocking)
            self._metrics.outbox_depth.set(depth)
            return moved

    def _drain_blocking(self) -> tuple[int, int]:
        """One worker-thread trip; (moved, depth left). Without a backlog the records
        put since the last trip go to the ledger in one batch, straight from the
        journal (:meth:`Outbox.take_fresh`); a backlog (or a batch that failed) goes
        through the outbox database, in batches, until empty or failing."""
        if not self._outbox.backlog():
            fresh = self._outbox.take_fresh()
            if not fresh:
                return 0, self._outbox.depth()
            try:
                self._sink.write([p for _, p in fresh])
            except (ValueError, TypeError, KeyError):  # a bad entry: the backlog isolates it
                self._outbox.keep_taken()
            except Exception as exc:
                self._outbox.keep_taken()
                self._note_failure(exc)
                return 0, self._outbox.depth()
            else:
                self._db_down_until = 0.0
                self._outbox.settle_taken()
                return len(fresh), self._outbox.depth()
        return self._drain_backlog(), self._outbox.depth()

    def _drain_backlog(self) -> int:
        """Batches from the outbox database until it is empty or the database fails."""
        moved = 0
        while True:
            batch = self._outbox.peek(DRAIN_BATCH)
            if not batch:
                break
            done = self._write_batch(batch)
            moved += done
            if done < len(batch):
                break
        return moved

    def _write_batch(self, batch: list[tuple[str, dict[str, Any]]]) -> int:
        """Write one batch; returns how many left the outbox (all, or 0 on a DB failure)."""
        try:
            self._sink.write([p for _, p in batch])
        except (ValueError, TypeError, KeyError):  # one bad entry: isolate it
            return self._write_one_by_one(batch)
        except Exception as exc:
            self._note_failure(exc)
            return 0
        self._db_down_until = 0.0
        self._outbox.remove([rid for rid, _ in batch])
        return len(batch)

    def _write_one_by_one(self, batch: list[tuple[str, dict[str, Any]]]) -> int:
        done: list[str] = []
        try:
            for request_id, payload in batch:
                try:
                    self._sink.write([payload])
                except (ValueError, TypeError, KeyError):
                    log.exception("usage entry refused as invalid, dropped: %s", payload)
                done.append(request_id)
        except Exception as exc:
            self._note_failure(exc)
        finally:
            self._outbox.remove(done)
        return len(done) if len(done) == len(batch) else 0

    def _note_failure(self, exc: BaseException) -> None:
        if not self.db_suspected_down:
            log.warning("ledger unavailable (%s); usage waits in the outbox", exc)
        self._metrics.ledger_failures.inc()
        self._db_down_until = self._clock() + self._retry_s

    async def close(self) -> None:
        """Stop the sink (a writer process) once the last drain is done."""
        async with self._drain_lock:
            await anyio.to_thread.run_sync(self._sink.close)

    async def run_drainer(self) -> None:
        """Drain ``batch_delay_s`` after a new entry (one transaction for all that arrived
        meanwhile), and every ``retry_interval_s``; while the database fails, at most
        once per ``retry_interval_s``. Cancel the task to stop."""
        while True:
            with anyio.move_on_after(self._retry_s):
                await self._wake.wait()
            await asyncio.sleep(self._batch_delay_s)  # let a few more entries arrive
            self._wake.clear()
            if self.db_suspected_down:
                await asyncio.sleep(max(0.0, self._db_down_until - self._clock()))
            try:
                await self.drain()
            except Exception:  # the outbox file itself failing: keep trying
                log.exception("outbox drain failed")
                await asyncio.sleep(self._retry_s)
