"""Per-key rate limits: in-process, Redis-shared, Redis-down fallback, 429 + Retry-After."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from sqlalchemy.orm import Session, sessionmaker

from kvtoll.settings import Settings
from proxy.config import RateLimitDefaults
from proxy.metrics import ProxyMetrics
from proxy.ratelimit import KeyLimits, LocalRateLimiter, RedisRateLimiter
from tests.proxy.helpers import MODEL, LiveServer, build_app, free_port, seed
from tests.proxy.scripted import ScriptedUpstream


class Clock:
    def __init__(self, now: float = 120.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _run(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


def test_local_requests_per_minute_and_window_reset() -> None:
    clock = Clock(120.0)
    limiter = LocalRateLimiter(clock)
    limits = KeyLimits(requests_per_minute=3, tokens_per_minute=10_000)

    async def scenario() -> None:
        for _ in range(3):
            assert (await limiter.check("k", limits, 10)).allowed
        refused = await limiter.check("k", limits, 10)
        assert (refused.allowed, refused.limit, refused.retry_after_s) == (False, "requests", 60)
        assert (await limiter.check("other", limits, 10)).allowed  # per key
        clock.now = 150.5
        assert (await limiter.check("k", limits, 10)).retry_after_s == 30
        clock.now = 180.0  # next window
        assert (await limiter.check("k", limits, 10)).allowed

    _run(scenario())


def test_local_tokens_per_minute() -> None:
    limiter = LocalRateLimiter(Clock())
    limits = KeyLimits(requests_per_minute=100, tokens_per_minute=100)

    async def scenario() -> None:
        assert (await limiter.check("k", limits, 60)).allowed
        refused = await limiter.check("k", limits, 50)
        assert (refused.allowed, refused.limit) == (False, "tokens")
        assert (await limiter.check("k", limits, 40)).allowed
        # one request bigger than the whole budget passes only in an empty window
        assert (await limiter.check("big", limits, 500)).allowed
        assert not (await limiter.check("big", limits, 1)).allowed

    _run(scenario())


@pytest.mark.redis
def test_redis_limits_are_shared_between_replicas(redis_url: str, redis_prefix: str) -> None:
    limits = KeyLimits(requests_per_minute=4, tokens_per_minute=10_000)

    async def scenario() -> None:
        replicas = [
            RedisRateLimiter.from_url(redis_url, RateLimitDefaults(), ProxyMetrics.create(),
                                      prefix=redis_prefix)
            for _ in range(2)
        ]
        try:
            results = [await replicas[i % 2].check("k", limits, 1) for i in range(6)]
            assert [r.allowed for r in results] == [True] * 4 + [False] * 2
            assert results[-1].limit == "requests" and 1 <= results[-1].retry_after_s <= 60
            assert not replicas[0].in_fallback
        finally:
            for replica in replicas:
                await replica.aclose()

    _run(scenario())


def test_redis_down_falls_back_to_conservative_local_limit() -> None:
    metrics = ProxyMetrics.create()
    defaults = RateLimitDefaults(fallback_divisor=4)
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    limits = KeyLimits(requests_per_minute=8, tokens_per_minute=10_000)

    async def scenario() -> None:
        limiter = RedisRateLimiter.from_url(dead, defaults, metrics, prefix="t:")
        try:
            allowed = [(await limiter.check("k", limits, 1)).allowed for _ in range(4)]
        finally:
            await limiter.aclose()
        assert allowed == [True, True, False, False]  # 8 // 4 = 2 per minute locally
        assert limiter.in_fallback

    _run(scenario())
    assert metrics.registry.get_sample_value("kvtoll_ratelimit_fallback") == 1.0


def _hammer(url: str, key: str, count: int) -> list[httpx.Response]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(timeout=30) as client:
        return [client.post(url + "/v1/chat/completions", json=body, headers=headers)
                for _ in range(count)]


def _check_429(responses: list[httpx.Response]) -> None:
    assert [r.status_code for r in responses] == [200, 200, 429]
    refused = responses[-1]
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"


def test_http_429_in_process(settings: Settings, db: sessionmaker[Session]) -> None:
    tenants = seed(db, rpm=2)
    with LiveServer(build_app(settings, db, upstreams=[ScriptedUpstream()])) as server:
        _check_429(_hammer(server.url, tenants.key_a, 3))
        assert _hammer(server.url, tenants.key_b, 1)[0].status_code == 200


@pytest.mark.redis
def test_http_429_with_redis(
    settings: Settings, db: sessionmaker[Session], redis_url: str, redis_prefix: str
) -> None:
    tenants = seed(db, rpm=2)
    shared = settings.model_copy(update={"redis_url": redis_url})
    apps = [build_app(shared, db, upstreams=[ScriptedUpstream()], ratelimit_prefix=redis_prefix)
            for _ in range(2)]
    with LiveServer(apps[0]) as one, LiveServer(apps[1]) as two:
        responses = _hammer(one.url, tenants.key_a, 1) + _hammer(two.url, tenants.key_a, 2)
        _check_429(responses)


@given(
    steps=st.lists(
        st.tuples(st.sampled_from(["k1", "k2"]), st.integers(1, 80), st.floats(0, 30)),
        max_size=60,
    ),
    rpm=st.integers(1, 6),
    tpm=st.integers(50, 300),
)
@hypothesis_settings(max_examples=60, deadline=None)
def test_local_limits_hold_in_every_window(
    steps: list[tuple[str, int, float]], rpm: int, tpm: int
) -> None:
    """Per key and window: admitted requests <= rpm; admitted tokens <= tpm, except
    that a single request bigger than tpm may be the first of an empty window."""
    clock = Clock(0.0)
    limiter = LocalRateLimiter(clock)
    limits = KeyLimits(requests_per_minute=rpm, tokens_per_minute=tpm)
    admitted: dict[tuple[str, int], list[int]] = {}

    async def scenario() -> None:
        for key, cost, advance in steps:
            clock.now += advance
            decision = await limiter.check(key, limits, cost)
            window = int(clock.now // 60)
            if decision.allowed:
                admitted.setdefault((key, window), []).append(cost)
            else:
                assert 1 <= decision.retry_after_s <= 60
                assert decision.limit in ("requests", "tokens")

    _run(scenario())
    for costs in admitted.values():
        assert len(costs) <= rpm
        assert sum(costs) <= tpm or (len(costs) == 1 and costs[0] > tpm)


def test_refund_gives_a_failed_request_back_in_its_window() -> None:
    clock = Clock()
    limiter = LocalRateLimiter(clock)
    limits = KeyLimits(requests_per_minute=2, tokens_per_minute=10_000)

    async def scenario() -> None:
        first = await limiter.check("k", limits, 10)
        await limiter.refund("k", first, 10)  # it failed unserved
        assert (await limiter.check("k", limits, 10)).allowed
        assert (await limiter.check("k", limits, 10)).allowed
        assert not (await limiter.check("k", limits, 10)).allowed
        old = await limiter.check("other", limits, 1)
        clock.now += 60  # a refund for an earlier window changes nothing
        await limiter.refund("other", old, 1)
        assert (await limiter.check("other", limits, 1)).allowed

    _run(scenario())


@pytest.mark.redis
def test_redis_refund(redis_url: str, redis_prefix: str) -> None:
    limits = KeyLimits(requests_per_minute=1, tokens_per_minute=10_000)

    async def scenario() -> None:
        limiter = RedisRateLimiter.from_url(redis_url, RateLimitDefaults(),
                                            ProxyMetrics.create(), prefix=redis_prefix)
        try:
            first = await limiter.check("k", limits, 5)
            assert first.allowed and not (await limiter.check("k", limits, 5)).allowed
            await limiter.refund("k", first, 5)
            assert (await limiter.check("k", limits, 5)).allowed
        finally:
            await limiter.aclose()

    _run(scenario())


def test_requests_failing_unserved_do_not_use_the_rpm(
    settings: Settings, db: sessionmaker[Session]
) -> None:
    tenants = seed(db, rpm=2)
    down = ScriptedUpstream("down-0", fail_before_first=True)
    with LiveServer(build_app(settings, db, upstreams=[down])) as server:
        responses = _hammer(server.url, tenants.key_a, 4)
    assert [r.status_code for r in responses] == [502] * 4  # never 429
    assert all(r.headers["retry-after"] == "1" and r.headers["x-request-id"]
               for r in responses)
