"""Metering: exactly one ledger row per accepted request, even when the database is down.

:meth:`Meter.record` writes the entry through :func:`billing.ledger.write_usage`
(idempotent by request id). If that fails for any database reason the entry goes
to the durable :class:`~proxy.outbox.Outbox` instead, and for the next
``db_retry_after_failure_s`` seconds further entries go straight to the outbox (no
request waits on a dead database). :meth:`Meter.replay` moves outbox entries into the
ledger and deletes them only once written; it runs at startup (entries left by a
crashed process) and then every ``outbox_replay_interval_s`` in the background.
A replay that dies between the ledger write and the outbox delete is repeated, and
the ledger's unique request id turns the repeat into a no-op: nothing lost, nothing
billed twice.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import anyio
from sqlalchemy.orm import Session, sessionmaker

from billing.ledger import LedgerEntry, write_usage
from billing.models import ApiKeyId, RequestStatus, ServedBy, TenantId
from proxy.metrics import ProxyMetrics
from proxy.outbox import Outbox

log = logging.getLogger(__name__)
REPLAY_BATCH = 200


def entry_to_json(entry: LedgerEntry) -> dict[str, Any]:
    """A JSON-safe dict of ``entry`` (enums by value, times in ISO 8601 with offset)."""
    data = dataclasses.asdict(entry)
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


class Meter:
    """Ledger writes with a durable outbox fallback (see module doc)."""

    def __init__(
        self,
        factory: sessionmaker[Session],
        outbox: Outbox,
        metrics: ProxyMetrics,
        *,
        db_retry_after_failure_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._factory = factory
        self._outbox = outbox
        self._metrics = metrics
        self._retry_s = db_retry_after_failure_s
        self._clock = clock
        self._db_down_until = 0.0
        self._replay_lock = asyncio.Lock()

    @property
    def db_suspected_down(self) -> bool:
        return self._clock() < self._db_down_until

    async def record(self, entry: LedgerEntry) -> None:
        """Write ``entry`` to the ledger, or durably to the outbox; returns once it is safe."""
        if not self.db_suspected_down:
            try:
                await anyio.to_thread.run_sync(write_usage, self._factory, entry)
                return
            except ValueError:  # a bug upstream of here; replaying it could never succeed
                log.exception("ledger refused entry as invalid: %s", entry_to_json(entry))
                return
            except Exception as exc:
                log.warning("ledger write failed (%s); usage goes to the outbox", exc)
                self._db_down_until = self._clock() + self._retry_s
        self._metrics.ledger_failures.inc()
        await anyio.to_thread.run_sync(self._outbox.put, entry.request_id, entry_to_json(entry))
        self._metrics.outbox_depth.inc()

    async def replay(self) -> int:
        """Move every outbox entry into the ledger; returns how many were moved."""
        async with self._replay_lock:
            moved = 0
            while True:
                batch = await anyio.to_thread.run_sync(self._outbox.peek, REPLAY_BATCH)
                if not batch:
                    break
                done = await anyio.to_thread.run_sync(self._write_batch, batch)
                moved += len(done)
                if len(done) < len(batch):
                    break
            depth = await anyio.to_thread.run_sync(self._outbox.depth)
            self._metrics.outbox_depth.set(depth)
            return moved

    def _write_batch(self, batch: list[tuple[str, dict[str, Any]]]) -> list[str]:
        done: list[str] = []
        try:
            for request_id, payload in batch:
                try:
                    write_usage(self._factory, entry_from_json(payload))
                except (ValueError, TypeError, KeyError):  # can never be written: do not block
                    log.exception("outbox entry refused as invalid, dropped: %s", payload)
                done.append(request_id)
        except Exception as exc:
            log.info("outbox replay paused after %d entries: %s", len(done), exc)
            self._db_down_until = self._clock() + self._retry_s
        else:
            self._db_down_until = 0.0
        finally:
            self._outbox.remove(done)
        return done

    async def run_replayer(self, interval_s: float) -> None:
        """Replay forever every ``interval_s`` (cancel the task to stop)."""
        while True:
            try:
                await self.replay()
            except Exception:  # the outbox file itself failing: keep trying
                log.exception("outbox replay failed")
            await asyncio.sleep(interval_s)
