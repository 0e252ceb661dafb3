"""The worker side of scale-out over Redis, and the wire format routers read.

Announcement: key ``{prefix}workers:{name}`` holding JSON ``{"url", "kv_events",
"instance_id", "expires_at", "sigs"}`` (signed under the worker's tokens) with a TTL
(the heartbeat deadline): :func:`announce` sets it,
:class:`Heartbeat` renews it every ``ttl_s / 3`` and deletes it on a clean stop.

KV events: stream ``{prefix}kv:{name}``, one entry per engine event with fields
``instance``, ``seq``, ``kind`` and ``hashes`` (comma-separated hex block hashes),
appended by :class:`RedisEventPublisher` (bounded by MAXLEN) as
:func:`pump_engine_events` follows the engine's event log.

The key names and record formats are defined once, in :mod:`engine.api.wire`, which
the router reads too.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

from redis.asyncio import Redis

from engine.api import KVEvent
from engine.api.wire import (
    DEFAULT_PREFIX,
    EventTransport,
    announcement_body,
    announcement_key,
    event_fields,
    stream_key,
)


async def announce(
    redis: Redis,
    url: str,
    ttl_s: float,
    *,
    prefix: str = DEFAULT_PREFIX,
    name: str | None = None,
    kv_events: EventTransport = "http",
    instance_id: str | None = None,
    tokens: Sequence[str] = (),
) -> None:
    """Announce (or re-announce) a worker for ``ttl_s`` seconds, signed under each of
    ``tokens`` (the worker's accepted tokens; gateways refuse an unsigned record)."""
    if ttl_s <= 0:
        raise ValueError("ttl_s must be positive")
    worker_name = name or url.rstrip("/")
    body = announcement_body(worker_name, url.rstrip("/"), kv_events, instance_id,
                             time.time() + ttl_s, tokens)
    await redis.set(announcement_key(prefix, worker_name), body, px=max(1, int(ttl_s * 1000)))


class Heartbeat:
    """Re-announce every ``ttl_s / 3`` until stopped, then withdraw."""

    def __init__(self, redis: Redis, url: str, ttl_s: float, **announce_kwargs: Any) -> None:
        self._redis = redis
        self._url = url
        self._ttl = ttl_s
        self._kwargs = announce_kwargs

    async def run(self, stop: asyncio.Event) -> None:
        """Announce until ``stop`` is set; delete the key on the way out."""
        try:
            while not stop.is_set():
                await announce(self._redis, self._url, self._ttl, **self._kwargs)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=self._ttl / 3)
        finally:
            prefix = self._kwargs.get("prefix", DEFAULT_PREFIX)
            name = self._kwargs.get("name") or self._url.rstrip("/")
            with contextlib.suppress(Exception):
                await self._redis.delete(announcement_key(prefix, name))


class RedisEventPublisher:
    """Append KV events to the worker's Redis stream (bounded by MAXLEN)."""

    def __init__(
        self,
        redis: Redis,
        worker_name: str,
        instance_id: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        maxlen: int = 100_000,
    ) -> None:
        self._redis = redis
        self._key = stream_key(prefix, worker_name)
        self._instance = instance_id
        self._maxlen = maxlen

    async def publish(self, events: Sequence[KVEvent]) -> None:
        """XADD each event in order (one pipeline round trip)."""
        if not events:
            return
        async with self._redis.pipeline(transaction=False) as pipe:
            for e in events:
                fields = event_fields(self._instance, e)
                pipe.xadd(self._key, fields, maxlen=self._maxlen, approximate=True)  # type: ignore[arg-type]
            await pipe.execute()


async def pump_engine_events(
    read: Callable[[int, int], list[KVEvent]],
    publisher: RedisEventPublisher,
    stop: asyncio.Event,
    *,
    interval_s: float = 0.05,
    limit: int = 1000,
) -> None:
    """Follow the engine's event log (``AsyncEngineClient.kv_events``) and publish it
    until ``stop`` is set."""
    cursor = 0
    while not stop.is_set():
        events = read(cursor, limit)
        if events:
            await publisher.publish(events)
            cursor = events[-1].seq + 1
            continue
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=interval_s)


async def run_worker_presence(
    redis: Redis,
    public_url: str,
    read_events: Callable[[int, int], list[KVEvent]],
    instance_id: str,
    stop: asyncio.Event,
    *,
    ttl_s: float = 6.0,
    prefix: str = DEFAULT_PREFIX,
    name: str | None = None,
    publish_events: bool = True,
    tokens: Sequence[str] = (),
) -> None:
    """Announce (and publish events) until ``stop`` is set; then withdraw the
    announcement. ``read_events`` is the engine's ``kv_events(cursor, limit)``; no
    retry here (:mod:`engine.serving.registration` supervises it for ``kvtoll worker``)."""
    worker_name = name or public_url.rstrip("/")
    beat = Heartbeat(
        redis, public_url, ttl_s, prefix=prefix, name=worker_name,
        kv_events="redis" if publish_events else "http", instance_id=instance_id,
        tokens=tokens,
    )
    tasks = [beat.run(stop)]
    if publish_events:
        publisher = RedisEventPublisher(redis, worker_name, instance_id, prefix=prefix)
        tasks.append(pump_engine_events(read_events, publisher, stop))
    await asyncio.gather(*tasks)
