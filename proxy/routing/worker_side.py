"""What a worker process runs so routers find it and mirror its cache over Redis.

``kvtoll worker`` (when ``KVTOLL_REDIS_URL`` is set) can run :func:`run_worker_presence`
beside its server: a :class:`Heartbeat` announcing ``public_url`` every ``ttl_s / 3``
and, with ``publish_events``, a pump copying the engine's KV-event log into the
worker's Redis stream (routers then read the stream instead of polling HTTP).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from redis.asyncio import Redis

from engine.api import KVEvent
from proxy.routing.events import RedisEventPublisher, pump_engine_events
from proxy.routing.registry import Heartbeat


async def run_worker_presence(
    redis: Redis,
    public_url: str,
    read_events: Callable[[int, int], list[KVEvent]],
    instance_id: str,
    stop: asyncio.Event,
    *,
    ttl_s: float = 6.0,
    prefix: str = "kvtoll:",
    name: str | None = None,
    publish_events: bool = True,
) -> None:
    """Announce (and publish events) until ``stop`` is set; then withdraw the announcement.

    ``read_events`` is the engine's ``kv_events(cursor, limit)``.
    """
    worker_name = name or public_url.rstrip("/")
    beat = Heartbeat(
        redis,
        public_url,
        ttl_s,
        prefix=prefix,
        name=worker_name,
        kv_events="redis" if publish_events else "http",
        instance_id=instance_id,
    )
    tasks = [beat.run(stop)]
    if publish_events:
        publisher = RedisEventPublisher(redis, worker_name, instance_id, prefix=prefix)
        tasks.append(pump_engine_events(read_events, publisher, stop))
    await asyncio.gather(*tasks)
