"""Per-key rate limits: requests per minute and tokens per minute, as token buckets.

Algorithm: two token buckets per key, one counting requests and one counting tokens,
in the GCRA formulation (one number per bucket: the "theoretical arrival time"
``tat``, when the bucket would be full again). For a limit of ``L`` per minute and
``burst_s`` seconds of burst:

    rate      = L / 60 units per second (refill)
    capacity  = max(1, ceil(L * burst_s / 60)) units (what a full bucket holds)
    a request of cost c at time now:   base = max(tat, now);  new = base + c / rate
        admitted iff  new - now <= capacity / rate   (then tat = new)
        or, on the tokens bucket only, iff base <= now (the bucket is full: a request
        costing more than the whole capacity is slowed down, never refused forever)

A request costs 1 on the requests bucket and ``prompt tokens + max_tokens`` (the most it
can generate, charged up front) on the tokens bucket; it is admitted only if both
buckets admit it, and then both are charged. A request that fails before any of it was
served (no upstream could answer: 502/503/504) is handed back with
:meth:`RateLimiter.refund` (its charge is taken off both buckets' ``tat``, never below
now), so failures do not eat a key's budget. A key that has been idle
may send ``capacity`` requests at once, then ``rate`` per second; over any 60 s it
gets at most ``L * (1 + burst_s / 60)`` (no 2x at a window edge, as fixed windows
allowed). A refusal carries ``retry_after_s`` = seconds until the request would be
admitted (at least 1). ``burst_s`` comes from :class:`proxy.config.RateLimitDefaults`
(``KVTOLL_RATE_LIMIT_BURST_S``, default 10 s).

Backends: :class:`LocalRateLimiter` (in-process, one replica) and
:class:`RedisRateLimiter` (one atomic Lua script per check, one round trip, shared by
every replica; the clock is Redis's own ``TIME``, so replicas' clocks need not agree).
If Redis fails, the Redis limiter keeps serving with a local limiter that enforces
``limit // fallback_divisor`` and sets the ``kvtoll_ratelimit_fallback`` gauge to 1
until Redis answers again (tried every ``redis_retry_s``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from proxy.config import RateLimitDefaults
from proxy.metrics import ProxyMetrics

log = logging.getLogger(__name__)
MINUTE_S = 60.0


@dataclass(frozen=True)
class KeyLimits:
    requests_per_minute: int
    tokens_per_minute: int


@dataclass(frozen=True)
class RateDecision:
    allowed: bool
    retry_after_s: int = 0
    limit: str | None = None  # "requests" | "tokens" when refused
    # What an admitted request charged each bucket, in seconds of its tat (refund)
    charged_requests_s: float = 0.0
    charged_tokens_s: float = 0.0
    local: bool = False  # counted by a local limiter (the Redis limiter's fallback)


class RateLimiter(Protocol):
    async def check(self, key_id: str, limits: KeyLimits, cost_tokens: int) -> RateDecision:
        """Admit (and count) one request of ``cost_tokens`` for ``key_id``, or refuse it."""
        ...

    async def refund(self, key_id: str, decision: RateDecision, cost_tokens: int) -> None:
        """Take back an admitted request that failed unserved (a bucket that has refilled
        since stays full)."""
        ...

    async def aclose(self) -> None: ...


@dataclass(frozen=True)
class Bucket:
    """One bucket's parameters: seconds per unit and the burst tolerance in seconds
    (capacity x seconds per unit)."""

    interval_s: float
    tolerance_s: float

    @classmethod
    def of(cls, per_minute: int, burst_s: float) -> Bucket:
        per_minute = max(1, per_minute)
        interval = MINUTE_S / per_minute
        capacity = max(1, math.ceil(per_minute * burst_s / MINUTE_S))
        return cls(interval, capacity * interval)


# Float slack in bucket arithmetic (seconds): sums of intervals carry rounding errors.
EPS_S = 1e-9


def gcra(tat: float, now: float, bucket: Bucket, cost: int,
         oversized_when_full: bool) -> tuple[float, float]:
    """``(new_tat, wait_s)``: the bucket's next theoretical arrival time if the request is
    admitted, and 0 if it is, else the seconds until it would be."""
    base = max(tat, now)
    new = base + cost * bucket.interval_s
    over = new - now - bucket.tolerance_s
    if over <= EPS_S or (oversized_when_full and base <= now):
        return new, 0.0
    return new, min(over, base - now) if oversized_when_full else over


class BucketPairs:
    """The (requests, tokens) buckets of each distinct :class:`KeyLimits`, built once."""

    def __init__(self, burst_s: float) -> None:
        self._burst_s = burst_s
        self._pairs: dict[KeyLimits, tuple[Bucket, Bucket]] = {}

    def of(self, limits: KeyLimits) -> tuple[Bucket, Bucket]:
        pair = self._pairs.get(limits)
        if pair is None:
            if len(self._pairs) > 4096:  # many distinct per-key limits: start over
                self._pairs.clear()
            pair = self._pairs[limits] = (
                Bucket.of(limits.requests_per_minute, self._burst_s),
                Bucket.of(limits.tokens_per_minute, self._burst_s))
        return pair


def _retry(wait_s: float) -> int:
    # within gcra's tolerance of a whole second is that second: a 60 s wait computed as
    # 60.000000000000007 must not tell the client 61
    return max(1, math.ceil(wait_s - EPS_S))


class LocalRateLimiter:
    """In-process token buckets, one pair per key."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 burst_s: float = RateLimitDefaults.burst_s) -> None:
        self._clock = clock
        self._buckets = BucketPairs(burst_s)
        self._tats: dict[str, tuple[float, float]] = {}  # key -> (requests tat, tokens tat)

    async def check(self, key_id: str, limits: KeyLimits, cost_tokens: int) -> RateDecision:
        """See :class:`RateLimiter`."""
        return self.check_now(key_id, limits, cost_tokens)

    def check_now(self, key_id: str, limits: KeyLimits, cost_tokens: int) -> RateDecision:
        """:meth:`check` without a coroutine (it never waits)."""
        now = self._clock()
        requests, tokens = self._buckets.of(limits)
        tat_r, tat_t = self._tats.get(key_id, (now, now))
        new_r, wait_r = gcra(tat_r, now, requests, 1, False)
        if wait_r:
            return RateDecision(False, _retry(wait_r), "requests")
        new_t, wait_t = gcra(tat_t, now, tokens, cost_tokens, True)
        if wait_t:
            return RateDecision(False, _retry(wait_t), "tokens")
        self._tats[key_id] = (new_r, new_t)
        if len(self._tats) > 100_000:  # forget keys whose buckets are full again
            self._tats = {k: v for k, v in self._tats.items() if max(v) > now}
        return RateDecision(True, charged_requests_s=new_r - max(tat_r, now),
                            charged_tokens_s=new_t - max(tat_t, now), local=True)

    async def refund(self, key_id: str, decision: RateDecision, cost_tokens: int) -> None:
        """See :class:`RateLimiter`."""
        self.refund_now(key_id, decision)

    def refund_now(self, key_id: str, decision: RateDecision) -> None:
        tats = self._tats.get(key_id)
        if tats is None or not decision.allowed:
            return
        now = self._clock()
        self._tats[key_id] = (max(now, tats[0] - decision.charged_requests_s),
                              max(now, tats[1] - decision.charged_tokens_s))

    async def aclose(self) -> None:
        self._tats.clear()


# KEYS[1]: the key's hash {r: requests tat, t: tokens tat} in ms of Redis's clock.
# ARGV: requests interval ms, requests tolerance ms, tokens interval ms, tokens
# tolerance ms, cost in tokens. Returns {0 | 1 (requests) | 2 (tokens), wait ms}.
_LUA = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + tonumber(clock[2]) / 1000
local v = redis.call('HMGET', KEYS[1], 'r', 't')
local base_r = math.max(tonumber(v[1]) or now, now)
local new_r = base_r + tonumber(ARGV[1])
local over_r = new_r - now - tonumber(ARGV[2])
if over_r > 0.000001 then return {1, math.ceil(over_r)} end
local base_t = math.max(tonumber(v[2]) or now, now)
local new_t = base_t + tonumber(ARGV[5]) * tonumber(ARGV[3])
local over_t = new_t - now - tonumber(ARGV[4])
if over_t > 0.000001 and base_t > now then
  return {2, math.ceil(math.min(over_t, base_t - now))}
end
redis.call('HSET', KEYS[1], 'r', string.format('%.3f', new_r), 't', string.format('%.3f', new_t))
redis.call('PEXPIRE', KEYS[1], math.ceil(math.max(new_r, new_t) - now) + 1000)
return {0, 0}
"""
# KEYS[1]: as above; ARGV: ms to take off the requests tat, ms off the tokens tat.
_REFUND_LUA = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + tonumber(clock[2]) / 1000
local v = redis.call('HMGET', KEYS[1], 'r', 't')
if not v[1] then return 0 end
local r = math.max(now, tonumber(v[1]) - tonumber(ARGV[1]))
local t = math.max(now, tonumber(v[2]) - tonumber(ARGV[2]))
redis.call('HSET', KEYS[1], 'r', string.format('%.3f', r), 't', string.format('%.3f', t))
return 0
"""
_REFUSALS = {1: "requests", 2: "tokens"}


class RedisRateLimiter:
    """Shared limits in Redis with a conservative local fallback (see module doc)."""

    def __init__(
        self,
        client: Any,  # redis.asyncio.Redis
        defaults: RateLimitDefaults,
        metrics: ProxyMetrics,
        *,
        prefix: str = "kvtoll:rl:",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._client = client
        self._script = client.register_script(_LUA)
        self._refund = client.register_script(_REFUND_LUA)
        self._defaults = defaults
        self._metrics = metrics
        self._prefix = prefix
        self._clock = clock
        self._fallback = LocalRateLimiter(clock, burst_s=defaults.burst_s)
        self._retry_at = 0.0
        self._buckets = BucketPairs(defaults.burst_s)

    @classmethod
    def from_url(
        cls, url: str, defaults: RateLimitDefaults, metrics: ProxyMetrics, *, prefix: str,
        socket_timeout_s: float = 0.5,
    ) -> RedisRateLimiter:
        """Connect lazily to ``url`` with short timeouts, so an outage is noticed fast."""
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(
            url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s,
            retry_on_timeout=False,
        )
        return cls(client, defaults, metrics, prefix=prefix)

    @property
    def in_fallback(self) -> bool:
        return self._retry_at > 0.0

    async def check(self, key_id: str, limits: KeyLimits, cost_tokens: int) -> RateDecision:
        """See :class:`RateLimiter`; falls back to local limits while Redis is down."""
        now = self._clock()
        if self._retry_at and now < self._retry_at:
            return await self._local(key_id, limits, cost_tokens)
        requests, tokens = self._buckets.of(limits)
        keys = self._keys(key_id)
        args = [requests.interval_s * 1000, requests.tolerance_s * 1000,
                tokens.interval_s * 1000, tokens.tolerance_s * 1000, cost_tokens]
        try:
            code, wait_ms = (int(x) for x in await self._script(keys=keys, args=args))
        except Exception as exc:  # any Redis/network failure: degrade, never fail the request
            log.warning("rate limiter: Redis unavailable (%s); local fallback limits", exc)
            self._retry_at = now + self._defaults.redis_retry_s
            self._metrics.ratelimit_fallback.set(1)
            return await self._local(key_id, limits, cost_tokens)
        if self._retry_at:
            log.info("rate limiter: Redis is back")
            self._retry_at = 0.0
            self._metrics.ratelimit_fallback.set(0)
        if code:
            return RateDecision(False, _retry(wait_ms / 1000), _REFUSALS[code])
        # the charge; a bucket already past full is charged the same (refunds floor at now)
        return RateDecision(True, charged_requests_s=requests.interval_s,
                            charged_tokens_s=cost_tokens * tokens.interval_s)

    def _keys(self, key_id: str) -> list[str]:
        return [f"{self._prefix}{{{key_id}}}:b"]

    async def refund(self, key_id: str, decision: RateDecision, cost_tokens: int) -> None:
        """See :class:`RateLimiter`; a request counted by the local fallback is refunded
        there; a Redis failure loses the refund (never fails the request)."""
        if not decision.allowed:
            return
        if decision.local:
            self._fallback.refund_now(key_id, decision)
            return
        try:
            await self._refund(keys=self._keys(key_id), args=[
                decision.charged_requests_s * 1000, decision.charged_tokens_s * 1000])
        except Exception as exc:
            log.debug("rate limiter: refund lost (%s)", exc)

    async def _local(self, key_id: str, limits: KeyLimits, cost_tokens: int) -> RateDecision:
        div = max(1, self._defaults.fallback_divisor)
        reduced = KeyLimits(
            max(1, limits.requests_per_minute // div), max(1, limits.tokens_per_minute // div)
        )
        return self._fallback.check_now(key_id, reduced, cost_tokens)

    async def aclose(self) -> None:
        await self._client.aclose()
