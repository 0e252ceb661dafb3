"""Month-to-date spend counters (integer picodollars), in the rate limits' store.

Operations (each atomic over the keys it names):

- ``reserve(keys, limits, amount)``: if every ``keys[i] < limits[i]``, add ``amount``
  to every key and admit; else refuse, naming the first key at or over its limit.
  Either way it returns the values seen before.
- ``add(keys, delta)``: settle a reservation (``delta`` = actual - reserved, <= 0
  usually).
- ``raise_to(floors)``: reconcile with the ledger: ``key = max(key, floor)``. Never
  lowers a counter, so reservations in flight and spend the ledger has not seen yet
  (the outbox trails by milliseconds) are never lost.
- ``read(keys)``: current values (gauges).

Backends: :class:`LocalSpendCounters` (one process) and :class:`RedisSpendCounters`
(Lua scripts; comparisons on the decimal strings, so they are exact beyond 2^53).
While Redis fails, the Redis backend carries on with a local mirror of the values
it last saw plus what it charged since (gauge ``kvtoll_budget_fallback`` = 1) and
hands those charges to Redis when it answers again (tried every ``retry_s``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from proxy.metrics import ProxyMetrics

log = logging.getLogger(__name__)
COUNTER_TTL_S = 40 * 86400  # a month's counter outlives its month, then expires


@dataclass(frozen=True)
class Reservation:
    allowed: bool
    before: tuple[int, ...]  # each key's value before this call
    refused_index: int | None = None  # the first key at or over its limit


class SpendCounters(Protocol):
    async def reserve(self, keys: Sequence[str], limits: Sequence[int],
                      amount: int) -> Reservation: ...

    async def add(self, keys: Sequence[str], delta: int) -> None: ...

    async def raise_to(self, floors: Mapping[str, int]) -> None: ...

    async def read(self, keys: Sequence[str]) -> list[int]: ...

    async def aclose(self) -> None: ...


class LocalSpendCounters:
    """In-process counters (no await inside an operation: atomic on the event loop)."""

    def __init__(self) -> None:
        self._values: dict[str, int] = {}

    async def reserve(self, keys: Sequence[str], limits: Sequence[int],
                      amount: int) -> Reservation:
        return self.reserve_now(keys, limits, amount)

    def reserve_now(self, keys: Sequence[str], limits: Sequence[int],
                    amount: int) -> Reservation:
        before = tuple(self._values.get(k, 0) for k in keys)
        for i, (value, limit) in enumerate(zip(before, limits, strict=True)):
            if value >= limit:
                return Reservation(False, before, i)
        self.add_now(keys, amount)
        return Reservation(True, before)

    async def add(self, keys: Sequence[str], delta: int) -> None:
        self.add_now(keys, delta)

    def add_now(self, keys: Sequence[str], delta: int) -> None:
        for k in keys:
            self._values[k] = self._values.get(k, 0) + delta

    async def raise_to(self, floors: Mapping[str, int]) -> None:
        for k, floor in floors.items():
            self._values[k] = max(self._values.get(k, 0), floor)

    def set_now(self, key: str, value: int) -> None:
        self._values[key] = value

    async def read(self, keys: Sequence[str]) -> list[int]:
        return [self._values.get(k, 0) for k in keys]

    async def aclose(self) -> None:
        self._values.clear()


# ge(a, b): a >= b for canonical integer strings (no float on the way)
_GE = """
local function ge(a, b)
  local na, nb = a:sub(1, 1) == '-', b:sub(1, 1) == '-'
  if na ~= nb then return nb end
  if na then a, b = b:sub(2), a:sub(2) end
  if #a ~= #b then return #a > #b end
  return a >= b
end
"""
_RESERVE = _GE + """
local n = #KEYS
local out = {0}
for i = 1, n do out[i + 1] = redis.call('GET', KEYS[i]) or '0' end
for i = 1, n do if ge(out[i + 1], ARGV[i]) then out[1] = i; return out end end
for i = 1, n do
  redis.call('INCRBY', KEYS[i], ARGV[n + 1]); redis.call('EXPIRE', KEYS[i], ARGV[n + 2])
end
return out
"""
_ADD = """
for i = 1, #KEYS do
  redis.call('INCRBY', KEYS[i], ARGV[1]); redis.call('EXPIRE', KEYS[i], ARGV[2])
end
return 0
"""
_RAISE = _GE + """
for i = 1, #KEYS do
  if not ge(redis.call('GET', KEYS[i]) or '0', ARGV[i]) then
    redis.call('SET', KEYS[i], ARGV[i], 'EX', ARGV[#KEYS + 1])
  end
end
return 0
"""


class RedisSpendCounters:
    """Counters shared by every gateway, with a local fallback (see module doc)."""

    def __init__(self, client: Any, metrics: ProxyMetrics, *, retry_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._client = client
        self._reserve = client.register_script(_RESERVE)
        self._add = client.register_script(_ADD)
        self._raise = client.register_script(_RAISE)
        self._metrics = metrics
        self._retry_s = retry_s
        self._clock = clock
        self._mirror = LocalSpendCounters()
        self._unsynced: dict[str, int] = {}  # charged locally while Redis was down
        self._retry_at = 0.0

    @classmethod
    def from_url(cls, url: str, metrics: ProxyMetrics,
                 socket_timeout_s: float = 0.5) -> RedisSpendCounters:
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(
            url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s,
            retry_on_timeout=False,
        )
        return cls(client, metrics)

    @property
    def in_fallback(self) -> bool:
        return self._retry_at > 0.0

    async def _usable(self) -> bool:
        """False while in fallback and not yet time to retry; on a retry, first hands
        the charges made meanwhile to Redis."""
        if not self._retry_at:
            return True
        if self._clock() < self._retry_at:
            return False
        try:
            for key, delta in list(self._unsynced.items()):
                await self._add(keys=[key], args=[delta, COUNTER_TTL_S])
                del self._unsynced[key]
        except Exception as exc:
            self._fail(exc)
            return False
        log.info("budget counters: Redis is back")
        self._retry_at = 0.0
        self._metrics.budget_fallback.set(0)
        return True

    def _fail(self, exc: BaseException) -> None:
        if not self._retry_at:
            log.warning("budget counters: Redis unavailable (%s); local counters", exc)
        self._retry_at = self._clock() + self._retry_s
        self._metrics.budget_fallback.set(1)

    def _local_add(self, keys: Sequence[str], delta: int) -> None:
        self._mirror.add_now(keys, delta)
        for k in keys:
            self._unsynced[k] = self._unsynced.get(k, 0) + delta

    async def reserve(self, keys: Sequence[str], limits: Sequence[int],
                      amount: int) -> Reservation:
        if await self._usable():
            try:
                raw = await self._reserve(
                    keys=list(keys), args=[*map(str, limits), amount, COUNTER_TTL_S])
            except Exception as exc:  # any Redis failure: degrade, never fail the request
                self._fail(exc)
            else:
                code, before = int(raw[0]), tuple(int(v) for v in raw[1:])
                for k, value in zip(keys, before, strict=True):
                    self._mirror.set_now(k, value + (0 if code else amount))
                return Reservation(code == 0, before, code - 1 if code else None)
        decision = self._mirror.reserve_now(keys, limits, 0)
        if decision.allowed:
            self._local_add(keys, amount)
        return decision

    async def add(self, keys: Sequence[str], delta: int) -> None:
        if delta == 0:
            return
        if await self._usable():
            try:
                await self._add(keys=list(keys), args=[delta, COUNTER_TTL_S])
            except Exception as exc:
                self._fail(exc)
            else:
                self._mirror.add_now(keys, delta)
                return
        self._local_add(keys, delta)

    async def raise_to(self, floors: Mapping[str, int]) -> None:
        await self._mirror.raise_to(floors)
        if not floors or not await self._usable():
            return
        try:
            await self._raise(keys=list(floors), args=[*map(str, floors.values()), COUNTER_TTL_S])
        except Exception as exc:
            self._fail(exc)

    async def read(self, keys: Sequence[str]) -> list[int]:
        if keys and await self._usable():
            try:
                values = [int(v or 0) for v in await self._client.mget(list(keys))]
            except Exception as exc:
                self._fail(exc)
            else:
                for k, value in zip(keys, values, strict=True):
                    self._mirror.set_now(k, value)
                return values
        return await self._mirror.read(keys)

    async def aclose(self) -> None:
        await self._client.aclose()
