"""Scale-out wiring of a worker: announce it in Redis and publish its KV events there.

When ``kvtoll worker`` runs with a Redis URL, the worker (name = its advertised
URL) re-announces itself every ``ttl_s / 3`` seconds (:class:`Heartbeat` from
:mod:`engine.serving.kv_publish`, which also defines the wire format the router
reads: a key that expires ``ttl_s`` after the last beat, deleted on a clean stop)
and, with ``kv_events="redis"``, follows the engine's event log into its
Redis stream (:func:`pump_engine_events`). The announcement is signed under the
worker's tokens (``tokens``): gateways take no unsigned or expired registration.
Either task that loses Redis logs it and retries every ``retry_s`` seconds: the
worker keeps serving meanwhile, and the router falls back on its own probes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

from redis.asyncio import Redis
from redis.exceptions import RedisError

from engine.api import AsyncEngineClient
from engine.serving.kv_publish import Heartbeat, RedisEventPublisher, pump_engine_events

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Registration:
    """How a worker makes itself known to the proxies."""

    redis_url: str
    advertise_url: str  # what proxies should call, e.g. http://10.0.0.5:8001
    ttl_s: float = 10.0
    kv_events: Literal["http", "redis"] = "redis"
    prefix: str = "kvtoll:"
    retry_s: float = 1.0
    tokens: tuple[str, ...] = ()  # the worker's accepted tokens, current first

    @property
    def name(self) -> str:
        return self.advertise_url.rstrip("/")


async def _supervise(
    what: str, run: Callable[[], Awaitable[None]], stop: asyncio.Event, retry_s: float
) -> None:
    while not stop.is_set():
        try:
            await run()
        except (RedisError, OSError) as exc:
            log.warning("%s: Redis unavailable (%s); retrying in %.1fs", what, exc, retry_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=retry_s)


async def run_registration(
    registration: Registration, engine: AsyncEngineClient, instance_id: str, stop: asyncio.Event
) -> None:
    """Heartbeat (and event publishing) until ``stop`` is set; then withdraw."""
    redis = Redis.from_url(registration.redis_url)
    heartbeat = Heartbeat(
        redis,
        registration.name,
        registration.ttl_s,
        prefix=registration.prefix,
        name=registration.name,
        kv_events=registration.kv_events,
        instance_id=instance_id,
        tokens=registration.tokens,
    )
    tasks = [_supervise("heartbeat", lambda: heartbeat.run(stop), stop, registration.retry_s)]
    if registration.kv_events == "redis":
        publisher = RedisEventPublisher(
            redis, registration.name, instance_id, prefix=registration.prefix
        )
        tasks.append(
            _supervise(
                "kv events",
                lambda: pump_engine_events(engine.kv_events, publisher, stop),
                stop,
                registration.retry_s,
            )
        )
    try:
        await asyncio.gather(*tasks)
    finally:
        await redis.aclose()
