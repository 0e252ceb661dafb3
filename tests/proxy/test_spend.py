"""Spend counters: reserve under the limit, settle, reconcile upwards only; exact past
2^53 picodollars; Redis shared between gateways, and a local fallback while it is down."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from proxy.metrics import ProxyMetrics
from proxy.spend import LocalSpendCounters, RedisSpendCounters, SpendCounters
from tests.proxy.helpers import free_port

BIG = 2**60  # far past what a double holds exactly


async def _contract(counters: SpendCounters, a: str, b: str) -> None:
    first = await counters.reserve([a, b], [100, 1000], 60)
    assert (first.allowed, first.before) == (True, (0, 0))
    second = await counters.reserve([a, b], [100, 1000], 60)
    assert (second.allowed, second.before) == (True, (60, 60))  # under the limit: admitted
    third = await counters.reserve([a, b], [100, 1000], 1)
    assert (third.allowed, third.refused_index, third.before) == (False, 0, (120, 120))
    await counters.add([a, b], -50)  # a settlement: cost less than reserved
    assert await counters.read([a, b]) == [70, 70]
    await counters.raise_to({a: 10, b: 500})  # the ledger knew more for b only
    assert await counters.read([a, b]) == [70, 500]
    big = await counters.reserve([b], [BIG + 2], BIG)
    assert big.allowed and await counters.read([b]) == [BIG + 500]
    over = await counters.reserve([b], [BIG + 500], 1)  # equal to the limit: refused
    assert not over.allowed and over.before == (BIG + 500,)
    assert (await counters.reserve([b], [BIG + 501], 1)).allowed


def test_local_counters() -> None:
    asyncio.run(_contract(LocalSpendCounters(), "a", "b"))


@pytest.mark.redis
def test_redis_counters_are_exact_and_shared(redis_url: str, redis_prefix: str) -> None:
    async def scenario() -> None:
        metrics = ProxyMetrics.create()
        one = RedisSpendCounters.from_url(redis_url, metrics)
        two = RedisSpendCounters.from_url(redis_url, metrics)
        try:
            await _contract(one, f"{redis_prefix}{{t}}:a", f"{redis_prefix}{{t}}:b")
            seen = await two.read([f"{redis_prefix}{{t}}:a", f"{redis_prefix}{{t}}:b"])
            assert seen == [70, BIG + 501]
            assert not one.in_fallback
        finally:
            await one.aclose()
            await two.aclose()

    asyncio.run(scenario())


def test_redis_down_keeps_counting_locally() -> None:
    metrics = ProxyMetrics.create()

    async def scenario() -> None:
        counters = RedisSpendCounters.from_url(f"redis://127.0.0.1:{free_port()}/0", metrics)
        try:
            await _contract(counters, "a", "b")
            assert counters.in_fallback
        finally:
            await counters.aclose()

    asyncio.run(scenario())
    assert metrics.registry.get_sample_value("kvtoll_budget_fallback") == 1.0


@pytest.mark.redis
def test_charges_made_during_an_outage_reach_redis(redis_url: str, redis_prefix: str) -> None:
    key = f"{redis_prefix}{{t}}:x"

    async def scenario() -> None:
        clock = [0.0]
        counters = RedisSpendCounters(_Flaky(redis_url), ProxyMetrics.create(), retry_s=5,
                                      clock=lambda: clock[0])
        client: _Flaky = counters._client
        try:
            assert (await counters.reserve([key], [1000], 10)).allowed  # Redis: 10
            client.down = True
            assert (await counters.reserve([key], [1000], 5)).allowed  # local: 15
            assert counters.in_fallback and await counters.read([key]) == [15]
            client.down = False
            clock[0] = 10.0  # time to try Redis again: the 5 charged meanwhile go there
            assert (await counters.reserve([key], [1000], 1)).before == (15,)
            assert not counters.in_fallback
        finally:
            await counters.aclose()

    asyncio.run(scenario())


class _Flaky:
    """A redis.asyncio client whose scripts fail while ``down`` (an outage on demand)."""

    def __init__(self, url: str) -> None:
        import redis.asyncio as aioredis

        self.real = aioredis.Redis.from_url(url)
        self.down = False

    def register_script(self, source: str) -> Callable[..., Awaitable[object]]:
        script = self.real.register_script(source)

        async def call(**kwargs: Any) -> object:
            if self.down:
                raise ConnectionError("redis is down")
            return await script(**kwargs)

        return call

    async def mget(self, keys: list[str]) -> list[object]:
        if self.down:
            raise ConnectionError("redis is down")
        return list(await self.real.mget(keys))

    async def aclose(self) -> None:
        await self.real.aclose()
