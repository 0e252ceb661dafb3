"""KV-event transports from workers into the router's :class:`PreciseIndex`.

* HTTP polling: ``GET {worker}/kv/events?cursor=N&limit=L`` answers
  ``{"instance_id", "block_size", "events": [{"seq", "kind", "block_hashes": [hex]}],
  "next_cursor"}`` (``engine/serving/app.py``).
* Redis streams (when configured): the worker's ``RedisEventPublisher``
  (:mod:`engine.serving.kv_publish`, which defines the stream format) XADDs each
  event to ``{prefix}kv:{worker}`` with fields ``instance``, ``seq``, ``kind`` and
  ``hashes`` (comma-separated hex); :class:`RedisEventConsumer` XREADs them.

Ordering is by ``seq``; a gap (events lost to log trimming) resets that worker's
entries (the index handles it). A worker restart — a new ``instance_id`` or a new
registry incarnation — also resets it and restarts from cursor 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from redis.asyncio import Redis

from engine.api import KVEvent, KVEventKind
from engine.api.wire import stream_key
from engine.kv.hashing import BlockHash
from proxy.routing.index import PreciseIndex
from proxy.routing.outage import OutageLog
from proxy.routing.registry import WorkerInfo, WorkerRegistry
from proxy.routing.types import WorkerId

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EventBatch:
    events: tuple[KVEvent, ...]
    next_cursor: int
    instance_id: str | None


def parse_event(
    seq: object, kind: object, hashes: Sequence[object], tenant: object = ""
) -> KVEvent:
    """One event from wire values; ``ValueError`` when malformed."""
    try:
        return KVEvent(
            int(str(seq)),
            KVEventKind(str(kind)),
            tuple(BlockHash(bytes.fromhex(str(h))) for h in hashes),
            str(tenant or ""),
        )
    except (TypeError, ValueError) as exc:
        raise ValueError(f"malformed KV event: {exc}") from exc


def parse_events_payload(payload: dict[str, Any]) -> EventBatch:
    """A ``GET /kv/events`` body."""
    events = tuple(
        parse_event(e["seq"], e["kind"], e.get("block_hashes", ()), e.get("tenant", ""))
        for e in payload["events"]
    )
    instance = payload.get("instance_id")
    return EventBatch(events, int(payload["next_cursor"]), str(instance) if instance else None)


class HttpEventFeed:
    """Polls one worker's ``/kv/events`` into the index."""

    def __init__(
        self,
        worker_id: WorkerId,
        url: str,
        index: PreciseIndex,
        http: httpx.AsyncClient,
        *,
        limit: int = 1000,
    ) -> None:
        self.worker_id = worker_id
        self.url = url.rstrip("/")
        self._index = index
        self._http = http
        self._limit = limit
        self._instance_id: str | None = None

    def reset(self) -> None:
        """Forget the worker's cache and start again from cursor 0."""
        self._index.reset_worker(self.worker_id, 0)
        self._instance_id = None

    async def poll_once(self) -> int:
        """Fetch and apply everything available now; the number of events applied."""
        applied = 0
        while True:
            cursor = self._index.next_seq(self.worker_id)
            response = await self._http.get(
                f"{self.url}/kv/events", params={"cursor": cursor, "limit": self._limit}
            )
            response.raise_for_status()
            batch = parse_events_payload(response.json())
            if self._restarted(batch, cursor):
                log.info("worker %s restarted: resetting its prefix index", self.worker_id)
                self.reset()
                self._instance_id = batch.instance_id
                continue
            self._instance_id = batch.instance_id
            applied += self._index.apply_events(self.worker_id, batch.events).num_applied
            if len(batch.events) < self._limit:
                return applied

    def _restarted(self, batch: EventBatch, cursor: int) -> bool:
        if self._instance_id is not None and batch.instance_id not in (None, self._instance_id):
            return True
        return batch.next_cursor < cursor  # a fresh log behind our cursor


class RedisEventConsumer:
    """Router side: XREAD the streams of the given workers into the index."""

    def __init__(self, redis: Redis, index: PreciseIndex, *, prefix: str = "kvtoll:") -> None:
        self._redis = redis
        self._index = index
        self._prefix = prefix
        self._last_ids: dict[WorkerId, str] = {}
        self._instances: dict[WorkerId, str] = {}

    def forget(self, worker_id: WorkerId) -> None:
        self._last_ids.pop(worker_id, None)
        self._instances.pop(worker_id, None)

    async def poll_once(self, worker_ids: Sequence[WorkerId], block_ms: int | None = None) -> int:
        """Read what is available (waiting up to ``block_ms``); events applied."""
        if not worker_ids:
            return 0
        streams = {stream_key(self._prefix, w): self._last_ids.get(w, "0-0") for w in worker_ids}
        by_key = {stream_key(self._prefix, w): w for w in worker_ids}
        replies: Any = await self._redis.xread(
            streams,  # type: ignore[arg-type]
            count=1000,
            block=block_ms,
        )
        applied = 0
        pairs = replies.items() if isinstance(replies, dict) else (replies or [])
        for key, entries in pairs:
            worker_id = by_key[_text(key)]
            applied += self._apply(worker_id, entries)
        return applied

    def _apply(self, worker_id: WorkerId, entries: Sequence[tuple[Any, dict[Any, Any]]]) -> int:
        applied = 0
        for entry_id, raw in entries:
            fields = {_text(k): _text(v) for k, v in raw.items()}
            self._last_ids[worker_id] = _text(entry_id)
            hashes = [h for h in fields.get("hashes", "").split(",") if h]
            event = parse_event(fields.get("seq"), fields.get("kind"), hashes, fields.get("tenant"))
            instance = fields.get("instance", "")
            if self._instances.get(worker_id, instance) != instance:
                log.info("worker %s restarted: resetting its prefix index", worker_id)
                self._index.reset_worker(worker_id, event.seq)
            self._instances[worker_id] = instance
            applied += self._index.apply_events(worker_id, [event]).num_applied
        return applied


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class EventFeeds:
    """Keeps the index in step with the registry: one feed per event-publishing worker;
    departed workers are dropped from the index, restarted ones reset."""

    def __init__(
        self,
        registry: WorkerRegistry,
        index: PreciseIndex,
        http: httpx.AsyncClient,
        redis_consumer: RedisEventConsumer | None = None,
    ) -> None:
        self._registry = registry
        self._index = index
        self._http = http
        self._redis = redis_consumer
        self._feeds: dict[WorkerId, HttpEventFeed] = {}
        self._incarnations: dict[WorkerId, int] = {}

    async def poll_once(self, block_ms: int | None = None) -> None:
        """Sync with the registry, then pull events from every healthy worker."""
        healthy = [w for w in self._sync(self._registry.workers()) if w.healthy]
        http_feeds = [self._feeds[w.worker_id] for w in healthy if w.kv_events == "http"]
        results = await asyncio.gather(*(f.poll_once() for f in http_feeds), return_exceptions=True)
        for feed, result in zip(http_feeds, results, strict=True):
            if isinstance(result, Exception):
                log.debug("KV events from %s failed: %s", feed.worker_id, result)
        redis_ids = [w.worker_id for w in healthy if w.kv_events == "redis"]
        if self._redis is not None and redis_ids:
            await self._redis.poll_once(redis_ids, block_ms)

    async def run(self, stop: asyncio.Event, interval_s: float = 0.1) -> None:
        """Poll until ``stop`` is set. A failure (Redis down) is logged once, as one
        line, and its recovery once; the polls failing meanwhile only at debug level."""
        outage = OutageLog(log, "KV event polling")
        while not stop.is_set():
            try:
                await self.poll_once()
            except Exception as exc:
                outage.failed(exc)
            else:
                outage.ok()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=interval_s)

    def _sync(self, workers: Sequence[WorkerInfo]) -> Sequence[WorkerInfo]:
        known = {w.worker_id for w in workers}
        for worker_id in [w for w in self._incarnations if w not in known]:
            self._index.remove_worker(worker_id)
            self._feeds.pop(worker_id, None)
            self._incarnations.pop(worker_id, None)
            if self._redis is not None:
                self._redis.forget(worker_id)
        for w in workers:
            if self._incarnations.get(w.worker_id) != w.incarnation:
                self._index.reset_worker(w.worker_id, 0)
                if self._redis is not None:
                    self._redis.forget(w.worker_id)
                self._incarnations[w.worker_id] = w.incarnation
                self._feeds[w.worker_id] = HttpEventFeed(
                    w.worker_id, w.url, self._index, self._http
                )
        return workers
