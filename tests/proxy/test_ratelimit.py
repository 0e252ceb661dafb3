"""Per-key rate limits: in-process, Redis-shared, Redis-down fallback, 429 + Retry-After."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest
from hypothesis import example, given
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


def test_local_requests_bucket_bursts_then_refills() -> None:
    clock = Clock(120.0)
    limiter = LocalRateLimiter(clock, burst_s=10.0)
    limits = KeyLimits(requests_per_minute=60, tokens_per_minute=1_000_000)  # 1/s, burst 10

    async def scenario() -> None:
        for _ in range(10):
            assert (await limiter.check("k", limits, 10)).allowed
        refused = await limiter.check("k", limits, 10)
        assert (refused.allowed, refused.limit, refused.retry_after_s) == (False, "requests", 1)
        assert (await limiter.check("other", limits, 10)).allowed  # per key
        clock.now += 1.0  # one request's worth refilled
        assert (await limiter.check("k", limits, 10)).allowed
        assert not (await limiter.check("k", limits, 10)).allowed
        clock.now += 600.0  # long idle: the bucket holds its capacity, no more
        assert [(await limiter.check("k", limits, 10)).allowed for _ in range(11)] == (
            [True] * 10 + [False])

    _run(scenario())


def test_local_tokens_bucket_and_oversized_request() -> None:
    clock = Clock()
    limiter = LocalRateLimiter(clock, burst_s=10.0)
    limits = KeyLimits(requests_per_minute=6000, tokens_per_minute=600)  # 10/s, holds 100

    async def scenario() -> None:
        assert (await limiter.check("k", limits, 60)).allowed
        refused = await limiter.check("k", limits, 50)
        assert (refused.allowed, refused.limit, refused.retry_after_s) == (False, "tokens", 1)
        assert (await limiter.check("k", limits, 40)).allowed
        # one request bigger than the whole bucket passes only when the bucket is full,
        # and leaves the bucket in debt: 400 tokens over, 40 s at 10/s (+ 0.1 s for this one)
        assert (await limiter.check("big", limits, 500)).allowed
        refused = await limiter.check("big", limits, 1)
        assert (refused.allowed, refused.retry_after_s) == (False, 41)
        clock.now += 41.0
        assert (await limiter.check("big", limits, 1)).allowed

    _run(scenario())


@pytest.mark.redis
def test_redis_limits_are_shared_between_replicas(redis_url: str, redis_prefix: str) -> None:
    limits = KeyLimits(requests_per_minute=4, tokens_per_minute=10_000)

    async def scenario() -> None:
        replicas = [
            RedisRateLimiter.from_url(redis_url, RateLimitDefaults(burst_s=60.0),
                                      ProxyMetrics.create(), prefix=redis_prefix)
            for _ in range(2)
        ]
        try:
            results = [await replicas[i % 2].check("k", limits, 1) for i in range(6)]
            assert [r.allowed for r in results] == [True] * 4 + [False] * 2
            # a bucket of 4, refilled one request every 15 s
            assert results[-1].limit == "requests" and 1 <= results[-1].retry_after_s <= 15
            assert not replicas[0].in_fallback
        finally:
            for replica in replicas:
                await replica.aclose()

    _run(scenario())


def test_redis_down_falls_back_to_conservative_local_limit() -> None:
    metrics = ProxyMetrics.create()
    defaults = RateLimitDefaults(fallback_divisor=4, burst_s=60.0)
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    limits = KeyLimits(requests_per_minute=8, tokens_per_minute=10_000)

    async def scenario() -> None:
        limiter = RedisRateLimiter.from_url(dead, defaults, metrics, prefix="t:")
        try:
            allowed = [(await limiter.check("k", limits, 1)).allowed for _ in range(4)]
        finally:
            await limiter.aclose()
        assert allowed == [True, True, False, False]  # 8 // 4 = 2 per minute (and burst) locally
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
    assert 1 <= int(refused.headers["retry-after"]) <= 30  # 2 per minute: one every 30 s
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"


def test_http_429_in_process(settings: Settings, db: sessionmaker[Session]) -> None:
    tenants = seed(db, rpm=2)
    burst = settings.model_copy(update={"rate_limit_burst_s": 60.0})  # a bucket of 2
    with LiveServer(build_app(burst, db, upstreams=[ScriptedUpstream()])) as server:
        _check_429(_hammer(server.url, tenants.key_a, 3))
        assert _hammer(server.url, tenants.key_b, 1)[0].status_code == 200


@pytest.mark.redis
def test_http_429_with_redis(
    settings: Settings, db: sessionmaker[Session], redis_url: str, redis_prefix: str
) -> None:
    tenants = seed(db, rpm=2)
    shared = settings.model_copy(update={"redis_url": redis_url, "rate_limit_burst_s": 60.0})
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
    burst_s=st.sampled_from([1.0, 10.0, 60.0]),
)
@hypothesis_settings(max_examples=80, deadline=None)
# found by hypothesis: a wait of exactly 60 s that float sums make 60.000000000000007
@example(steps=[("k1", 1, 8.765216003153615), ("k1", 1, 0.0)], rpm=1, tpm=50, burst_s=1.0)
# and a refusal behind the debt of an admitted request bigger than the bucket (60.8 s)
@example(steps=[("k1", 59, 0.0), ("k1", 1, 10.0)], rpm=6, tpm=50, burst_s=1.0)
def test_local_limits_hold_over_every_interval(
    steps: list[tuple[str, int, float]], rpm: int, tpm: int, burst_s: float
) -> None:
    """Per key, over the admitted requests i..j (times t_i <= t_j): their number is at
    most capacity + (t_j - t_i) * rate; their tokens too, except that the last may be
    one request bigger than the whole bucket, which needs the rest to fit in the
    refill alone. A refusal says which limit and when to retry."""
    clock = Clock(0.0)
    limiter = LocalRateLimiter(clock, burst_s=burst_s)
    limits = KeyLimits(requests_per_minute=rpm, tokens_per_minute=tpm)
    admitted: dict[str, list[tuple[float, int]]] = {}
    cap_r, cap_t = math.ceil(rpm * burst_s / 60), math.ceil(tpm * burst_s / 60)

    async def scenario() -> None:
        for key, cost, advance in steps:
            clock.now += advance
            decision = await limiter.check(key, limits, cost)
            if decision.allowed:
                admitted.setdefault(key, []).append((clock.now, cost))
            else:
                assert decision.limit in ("requests", "tokens")
                # at most the time to refill a full bucket, this request, or the debt an
                # admitted request bigger than the bucket left
                if decision.limit == "requests":
                    units, per_minute = cap_r, rpm
                else:
                    biggest = max((c for _, c in admitted.get(key, [])), default=0)
                    units, per_minute = max(cap_t, cost, biggest), tpm
                assert 1 <= decision.retry_after_s <= math.ceil(60 * units / per_minute)

    _run(scenario())
    for seq in admitted.values():
        for i in range(len(seq)):
            for j in range(i, len(seq)):
                span = seq[j][0] - seq[i][0]
                assert j - i + 1 <= cap_r + span * rpm / 60 + 1e-6
                tokens = sum(cost for _, cost in seq[i:j + 1])
                last = seq[j][1]
                bound = span * tpm / 60 + (last if last > cap_t else cap_t)
                assert tokens <= bound + 1e-6


def test_refund_gives_a_failed_request_back() -> None:
    clock = Clock()
    limiter = LocalRateLimiter(clock)
    limits = KeyLimits(requests_per_minute=1, tokens_per_minute=10_000)  # a bucket of 1

    async def scenario() -> None:
        first = await limiter.check("k", limits, 10)
        assert not (await limiter.check("k", limits, 10)).allowed
        await limiter.refund("k", first, 10)  # it failed unserved
        assert (await limiter.check("k", limits, 10)).allowed
        assert not (await limiter.check("k", limits, 10)).allowed
        old = await limiter.check("other", limits, 1)
        clock.now += 60  # the bucket refilled: a late refund adds nothing beyond full
        await limiter.refund("other", old, 1)
        assert (await limiter.check("other", limits, 1)).allowed
        assert not (await limiter.check("other", limits, 1)).allowed

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
