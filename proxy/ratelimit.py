"""Per-key rate limits: requests per minute and tokens per minute.

Algorithm: fixed one-minute windows aligned to the epoch minute. A request is
admitted when ``requests + 1 <= rpm`` and ``tokens + cost <= tpm`` for the current
window, where ``cost`` is the prompt tokens plus the ``max_tokens`` asked for (the
most the request can generate; charged up front). A request that fails before any
of it was served (no upstream could answer: 502/503/504) is handed back with
:meth:`RateLimiter.refund`, in the window that counted it, so failures do not eat a
key's budget. A single request
costing more than the whole ``tpm`` passes only as the first of an empty window, so
it is slowed down rather than refused forever. A refusal carries ``retry_after_s`` =
seconds until the window ends (at least 1).

Backends: :class:`LocalRateLimiter` (in-process, one replica) and
:class:`RedisRateLimiter` (one atomic Lua script per check, shared by every replica).
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
WINDOW_S = 60


@dataclass(frozen=True)
class KeyLimits:
    requests_per_minute: int
    tokens_per_minute: int


@dataclass(frozen=True)
class RateDecision:
    allowed: bool
    retry_after_s: int = 0
    limit: str | None = None  # "requests" | "tokens" when refused
    window: int | None = None  # the window that counted an admitted request


class RateLimiter(Protocol):
    async def check(self, key_id: str, limits: KeyLimits, cost_tokens: int) -> RateDecision:
        """Admit (and count) one request of ``cost_tokens`` for ``key_id``, or refuse it."""
        ...

    async def refund(self, key_id: str, decision: RateDecision, cost_tokens: int) -> None:
        """Take back an admitted request that failed unserved (a no-op once its window
        is over)."""
        ...

    async def aclose(self) -> None: ...


def _window(now: float) -> tuple[int, int]:
    """Current window number and seconds until it ends (at least 1)."""
    window = int(now // WINDOW_S)
    return window, max(1, math.ceil((window + 1) * WINDOW_S - now))


def _verdict(used_requests: int, used_tokens: int, limits: KeyLimits, cost: int) -> str | None:
    if used_requests + 1 > limits.requests_per_minute:
        return "requests"
    if used_tokens > 0 and used_tokens + cost > limits.tokens_per_minute:
        return "tokens"
    return None


class LocalRateLimiter:
    """In-process fixed-window counters, one entry per key."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._counts: dict[str, tuple[int, int, int]] = {}  # key -> (window, requests, tokens)

    async def check(self, key_id: str, limits: KeyLimits, cost_tokens: int) -> RateDecision:
        """See :class:`RateLimiter`."""
        window, retry = _window(self._clock())
        current, requests, tokens = self._counts.get(key_id, (window, 0, 0))
        if current != window:
            requests, tokens = 0, 0
        refused = _verdict(requests, tokens, limits, cost_tokens)
        if refused:
            return RateDecision(False, retry, refused)
        self._counts[key_id] = (window, requests + 1, tokens + cost_tokens)
        return RateDecision(True, window=window)

    async def refund(self, key_id: str, decision: RateDecision, cost_tokens: int) -> None:
        """See :class:`RateLimiter`."""
        current, requests, tokens = self._counts.get(key_id, (None, 0, 0))
        if current is None or current != decision.window:
            return
        self._counts[key_id] = (current, max(0, requests - 1), max(0, tokens - cost_tokens))

    async def aclose(self) -> None:
        self._counts.clear()


_LUA = """
local r = tonumber(redis.call('GET', KEYS[1]) or '0')
local t = tonumber(redis.call('GET', KEYS[2]) or '0')
local cost = tonumber(ARGV[3])
if r + 1 > tonumber(ARGV[1]) then return 1 end
if t > 0 and t + cost > tonumber(ARGV[2]) then return 2 end
redis.call('INCR', KEYS[1])
redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('INCRBY', KEYS[2], cost)
redis.call('EXPIRE', KEYS[2], ARGV[4])
return 0
"""
_REFUND_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 and tonumber(redis.call('GET', KEYS[1])) > 0 then
  redis.call('DECR', KEYS[1])
end
if redis.call('EXISTS', KEYS[2]) == 1 then
  local t = tonumber(redis.call('GET', KEYS[2]))
  redis.call('DECRBY', KEYS[2], math.min(t, tonumber(ARGV[1])))
end
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
        self._fallback = LocalRateLimiter(clock)
        self._retry_at = 0.0

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
        window, retry = _window(now)
        keys = self._keys(key_id, window)
        args = [limits.requests_per_minute, limits.tokens_per_minute, cost_tokens, WINDOW_S + 5]
        try:
            code = int(await self._script(keys=keys, args=args))
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
            return RateDecision(False, retry, _REFUSALS[code])
        return RateDecision(True, window=window)

    def _keys(self, key_id: str, window: int) -> list[str]:
        return [f"{self._prefix}{{{key_id}}}:{window}:r", f"{self._prefix}{{{key_id}}}:{window}:t"]

    async def refund(self, key_id: str, decision: RateDecision, cost_tokens: int) -> None:
        """See :class:`RateLimiter`; a request counted by the local fallback (no window)
        is refunded there; a Redis failure loses the refund (never fails the request)."""
        if decision.window is None or decision.window != _window(self._clock())[0]:
            return
        if self._retry_at:
            await self._fallback.refund(key_id, decision, cost_tokens)
            return
        try:
            await self._refund(keys=self._keys(key_id, decision.window), args=[cost_tokens])
        except Exception as exc:
            log.debug("rate limiter: refund lost (%s)", exc)

    async def _local(self, key_id: str, limits: KeyLimits, cost_tokens: int) -> RateDecision:
        div = max(1, self._defaults.fallback_divisor)
        reduced = KeyLimits(
            max(1, limits.requests_per_minute // div), max(1, limits.tokens_per_minute // div)
        )
        return await self._fallback.check(key_id, reduced, cost_tokens)

    async def aclose(self) -> None:
        await self._client.aclose()
