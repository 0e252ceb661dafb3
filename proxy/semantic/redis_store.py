"""Semantic-cache entries in Redis, shared by every proxy replica.

Layout (``p`` = key prefix, ``t`` = tenant id):

* ``p e:t:<id>``   hash: prompt, partition, answer (JSON), vec (float32 bytes), emb (the
                   name of the embedder that wrote vec), created, expires, last_hit, hits;
                   PEXPIRE a minute past its TTL as a backstop
* ``p lru:t``      sorted set id -> last hit (or creation): LRU eviction order
* ``p exp:t``      sorted set id -> expiry: the TTL sweep
* ``p tenants``    set of tenant ids with entries
* ``p bytes``      hash tenant -> bytes its entries take (each entry's ``size`` field;
                   limits and eviction: :mod:`proxy.semantic.capacity`)
* ``p feed``       stream of changes (put / delete / flush, with the writer's origin),
                   capped near ``feed_maxlen``; each replica follows it to keep its
                   FAISS mirror in sync and skips its own events
* ``p req:t:<rid>`` request id -> "entry id score" served (feedback by request id)
* the error bound's evidence (:mod:`proxy.semantic.bound`): fields ``c<bin>`` /
  ``w<bin>`` (correct / wrong observations per score bin) in the entry's hash (gone
  with it) and in ``p ev:t`` (the tenant's sum, kept), so every replica decides on
  the same evidence

A connection failure marks the store down for ``retry_after_s``; meanwhile every
call fails fast with :class:`StoreUnavailable`, which the service turns into a miss.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import numpy as np

from proxy.semantic.bound import NUM_BINS, Evidence, score_bin
from proxy.semantic.capacity import entry_size
from proxy.semantic.keys import PartitionKey
from proxy.semantic.store import CacheEntry, ChangeEvent, Clock, EntryId, StoreConfig

T = TypeVar("T")

_HIT_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[1], 'hits', 1)
redis.call('HSET', KEYS[1], 'last_hit', ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[1], ARGV[2])
return 1
"""

_OBSERVE_SCRIPT = """
redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
if KEYS[1] ~= '' and redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
end
return 1
"""
_EVIDENCE_FIELDS = [f"c{b}" for b in range(NUM_BINS)] + [f"w{b}" for b in range(NUM_BINS)]


# Entries name the embedder that wrote their vector (field ``emb``). Replicas from before
# that field read every entry's vector as their own model's, so this layout has a prefix
# of its own: during a rolling upgrade old and new replicas never read each other's
# entries (each side starts from its own), and the old prefix's keys age out by TTL.
DEFAULT_PREFIX = "kvtoll:sem:v2:"


class StoreUnavailable(RuntimeError):
    """The Redis backend is unreachable (the cache fails open)."""


class RedisStore:
    """:class:`~proxy.semantic.store.EntryStore` on Redis (see the module docstring)."""

    def __init__(
        self, url: str, config: StoreConfig | None = None, *, prefix: str = DEFAULT_PREFIX,
        clock: Clock = time.time, retry_after_s: float = 1.0, feed_maxlen: int = 100_000,
        connect_timeout_s: float = 0.25, socket_timeout_s: float = 3.0,
    ) -> None:  # fmt: skip
        import redis.asyncio as aioredis

        self._config = config or StoreConfig()
        self._p = prefix
        self._clock = clock
        self._retry_after_s = retry_after_s
        self._feed_maxlen = feed_maxlen
        self._origin = uuid.uuid4().hex
        self._down_until = 0.0
        self._redis: Any = aioredis.Redis.from_url(
            url, socket_connect_timeout=connect_timeout_s, socket_timeout=socket_timeout_s
        )
        self._hit_script = self._redis.register_script(_HIT_SCRIPT)
        self._observe_script = self._redis.register_script(_OBSERVE_SCRIPT)
        self.capacity = self._config.capacity_table()

    @property
    def config(self) -> StoreConfig:
        return self._config

    async def _call(self, fn: Callable[[], Awaitable[T]]) -> T:
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.exceptions import TimeoutError as RedisTimeoutError

        if time.monotonic() < self._down_until:
            raise StoreUnavailable("redis marked down")
        try:
            return await fn()
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            self._down_until = time.monotonic() + self._retry_after_s
            raise StoreUnavailable(str(exc)) from exc

    def _entry_key(self, tenant_id: str, entry_id: str) -> str:
        return f"{self._p}e:{tenant_id}:{entry_id}"

    def _event(self, op: str, tenant_id: str, **fields: Any) -> dict[str, Any]:
        return {"op": op, "origin": self._origin, "tenant": tenant_id, **fields}

    async def put(self, entry: CacheEntry) -> list[EntryId]:
        async def run() -> list[EntryId]:
            t = entry.tenant_id
            size = entry_size(entry)
            vec = np.asarray(entry.vector, dtype=np.float32).tobytes()
            key = self._entry_key(t, entry.entry_id)
            pipe = self._redis.pipeline(transaction=True)
            pipe.hset(key, mapping={
                "prompt": entry.prompt, "partition": entry.partition, "vec": vec,
                "emb": entry.embedder,
                "answer": json.dumps(entry.answer), "created": entry.created_at,
                "expires": entry.expires_at, "last_hit": entry.last_hit_at, "hits": entry.hit_count,
                "size": size,
            })  # fmt: skip
            pipe.hincrby(f"{self._p}bytes", t, size)
            ttl_ms = int((entry.expires_at - self._clock()) * 1000) + 60_000  # backstop only
            pipe.pexpire(key, max(1, ttl_ms))
            pipe.zadd(f"{self._p}lru:{t}", {entry.entry_id: entry.last_hit_at})
            pipe.zadd(f"{self._p}exp:{t}", {entry.entry_id: entry.expires_at})
            pipe.sadd(f"{self._p}tenants", t)
            fields = {"id": entry.entry_id, "partition": entry.partition, "prompt": entry.prompt,
                      "emb": entry.embedder}
            self._xadd(pipe, self._event("put", t, vec=vec, **fields))
            pipe.zcard(f"{self._p}lru:{t}")
            pipe.hget(f"{self._p}bytes", t)
            num_entries, num_bytes = (await pipe.execute())[-2:]
            return await self._evict(t, int(num_entries), int(num_bytes or 0))

        return await self._call(run)

    def _xadd(self, pipe: Any, fields: dict[str, Any]) -> None:
        pipe.xadd(f"{self._p}feed", fields, maxlen=self._feed_maxlen, approximate=True)

    async def _evict(self, tenant_id: str, num_entries: int, num_bytes: int) -> list[EntryId]:
        """The tenant's least recently used entries, one by one, until it fits."""
        ids: list[EntryId] = []
        while num_entries > 0 and self.capacity.over(tenant_id, num_entries, num_bytes):
            victims = await self._redis.zrange(f"{self._p}lru:{tenant_id}", 0, 0)
            if not victims:
                break
            entry_id = EntryId(victims[0].decode())
            num_bytes -= await self._delete(tenant_id, entry_id) or 0
            num_entries -= 1
            ids.append(entry_id)
        return ids

    async def _delete(self, tenant_id: str, entry_id: str) -> int | None:
        """Delete one entry; its size if it existed (0 for one stored without a size)."""
        key = self._entry_key(tenant_id, entry_id)
        pipe = self._redis.pipeline(transaction=True)
        pipe.hget(key, "size")
        pipe.delete(key)
        pipe.zrem(f"{self._p}lru:{tenant_id}", entry_id)
        pipe.zrem(f"{self._p}exp:{tenant_id}", entry_id)
        raw_size, deleted = (await pipe.execute())[:2]
        existed = bool(deleted)
        size = int(raw_size or 0)
        if existed:
            pipe = self._redis.pipeline(transaction=False)
            self._xadd(pipe, self._event("delete", tenant_id, id=entry_id))
            if size:
                pipe.hincrby(f"{self._p}bytes", tenant_id, -size)
            await pipe.execute()
        return size if existed else None

    async def get(self, tenant_id: str, entry_id: EntryId) -> CacheEntry | None:
        async def run() -> CacheEntry | None:
            raw = await self._redis.hgetall(self._entry_key(tenant_id, entry_id))
            return self._parse(tenant_id, entry_id, raw)

        return await self._call(run)

    def _parse(self, tenant_id: str, entry_id: str, raw: dict[bytes, bytes]) -> CacheEntry | None:
        if not raw or b"prompt" not in raw or b"vec" not in raw:
            return None
        expires = float(raw[b"expires"])
        if expires <= self._clock():
            return None
        return CacheEntry(
            entry_id=EntryId(entry_id), tenant_id=tenant_id,
            partition=PartitionKey(raw[b"partition"].decode()), prompt=raw[b"prompt"].decode(),
            answer=json.loads(raw[b"answer"]),
            vector=np.frombuffer(raw[b"vec"], dtype=np.float32).copy(),
            embedder=raw.get(b"emb", b"").decode(), created_at=float(raw[b"created"]),
            expires_at=expires,
            last_hit_at=float(raw[b"last_hit"]), hit_count=int(raw[b"hits"]),
        )  # fmt: skip

    async def record_hit(self, tenant_id: str, entry_id: EntryId) -> CacheEntry | None:
        async def run() -> CacheEntry | None:
            keys = [self._entry_key(tenant_id, entry_id), f"{self._p}lru:{tenant_id}"]
            if not await self._hit_script(keys=keys, args=[self._clock(), entry_id]):
                return None
            raw = await self._redis.hgetall(keys[0])
            return self._parse(tenant_id, entry_id, raw)

        return await self._call(run)

    async def delete(self, tenant_id: str, entry_id: EntryId) -> bool:
        return await self._call(lambda: self._delete(tenant_id, entry_id)) is not None

    async def flush(self, tenant_id: str) -> int:
        async def run() -> int:
            ids = await self._redis.zrange(f"{self._p}lru:{tenant_id}", 0, -1)
            pipe = self._redis.pipeline(transaction=True)
            for raw_id in ids:
                pipe.delete(self._entry_key(tenant_id, raw_id.decode()))
            pipe.delete(f"{self._p}lru:{tenant_id}", f"{self._p}exp:{tenant_id}")
            pipe.srem(f"{self._p}tenants", tenant_id)
            pipe.hdel(f"{self._p}bytes", tenant_id)
            self._xadd(pipe, self._event("flush", tenant_id))
            await pipe.execute()
            return len(ids)

        return await self._call(run)

    async def expire(self) -> list[tuple[str, EntryId]]:
        async def run() -> list[tuple[str, EntryId]]:
            removed: list[tuple[str, EntryId]] = []
            for raw_t in await self._redis.smembers(f"{self._p}tenants"):
                t = raw_t.decode()
                due = await self._redis.zrangebyscore(f"{self._p}exp:{t}", "-inf", self._clock())
                for raw_id in due:
                    await self._delete(t, raw_id.decode())
                    removed.append((t, EntryId(raw_id.decode())))
            return removed

        return await self._call(run)

    async def snapshot(self) -> tuple[str | None, list[CacheEntry]]:
        return await self._call(self._snapshot)

    async def _snapshot(self) -> tuple[str | None, list[CacheEntry]]:
        cursor = await self._last_feed_id()
        entries: list[CacheEntry] = []
        for raw_t in await self._redis.smembers(f"{self._p}tenants"):
            t = raw_t.decode()
            ids = [i.decode() for i in await self._redis.zrange(f"{self._p}lru:{t}", 0, -1)]
            for start in range(0, len(ids), 1000):
                chunk = ids[start : start + 1000]
                pipe = self._redis.pipeline(transaction=False)
                for entry_id in chunk:
                    pipe.hgetall(self._entry_key(t, entry_id))
                for entry_id, raw in zip(chunk, await pipe.execute(), strict=True):
                    entry = self._parse(t, entry_id, raw)
                    if entry is not None:
                        entries.append(entry)
        return cursor, entries

    async def _last_feed_id(self) -> str:
        last = await self._redis.xrevrange(f"{self._p}feed", count=1)
        return last[0][0].decode() if last else "0-0"

    async def changes(
        self, cursor: str | None, block_ms: int
    ) -> tuple[str | None, list[ChangeEvent]]:
        async def run() -> tuple[str | None, list[ChangeEvent]]:
            start = cursor or await self._last_feed_id()
            block = block_ms if block_ms > 0 else None
            reply = await self._redis.xread({f"{self._p}feed": start}, count=1000, block=block)
            events: list[ChangeEvent] = []
            for _, items in reply or []:
                for item_id, fields in items:
                    start = item_id.decode()
                    if fields.get(b"origin", b"").decode() != self._origin:
                        events.append(_event_from(fields))
            return start, events

        return await self._call(run)

    async def remember_request(
        self, tenant_id: str, request_id: str, entry_id: EntryId, score: float | None = None
    ) -> None:
        key = f"{self._p}req:{tenant_id}:{request_id}"
        ttl = max(1, int(self._config.request_memory_s))
        value = entry_id if score is None else f"{entry_id} {float(score)!r}"
        await self._call(lambda: self._redis.set(key, value, ex=ttl))

    async def entry_for_request(self, tenant_id: str, request_id: str) -> EntryId | None:
        served = await self.served_for_request(tenant_id, request_id)
        return served[0] if served else None

    async def served_for_request(
        self, tenant_id: str, request_id: str
    ) -> tuple[EntryId, float | None] | None:
        raw = await self._call(lambda: self._redis.get(f"{self._p}req:{tenant_id}:{request_id}"))
        if not raw:
            return None
        entry_id, _, score = raw.decode().partition(" ")
        return EntryId(entry_id), float(score) if score else None

    async def observe(
        self, tenant_id: str, entry_id: EntryId | None, score: float, correct: bool
    ) -> None:
        field = f"{'c' if correct else 'w'}{score_bin(score)}"
        entry_key = self._entry_key(tenant_id, entry_id) if entry_id else ""
        keys = [entry_key, f"{self._p}ev:{tenant_id}"]
        await self._call(lambda: self._observe_script(keys=keys, args=[field]))

    async def evidence(
        self, tenant_id: str, entry_ids: list[EntryId]
    ) -> tuple[Evidence, list[Evidence]]:
        async def run() -> tuple[Evidence, list[Evidence]]:
            pipe = self._redis.pipeline(transaction=False)
            pipe.hmget(f"{self._p}ev:{tenant_id}", _EVIDENCE_FIELDS)
            for entry_id in entry_ids:
                pipe.hmget(self._entry_key(tenant_id, entry_id), _EVIDENCE_FIELDS)
            tenant, *entries = await pipe.execute()
            return _evidence_of(tenant), [_evidence_of(raw) for raw in entries]

        return await self._call(run)

    async def aclose(self) -> None:
        await self._redis.aclose()


def _evidence_of(raw: list[bytes | None]) -> Evidence:
    counts = [int(v) if v else 0 for v in raw]
    return Evidence(tuple(counts[:NUM_BINS]), tuple(counts[NUM_BINS:]))


def _event_from(fields: dict[bytes, bytes]) -> ChangeEvent:
    op = fields[b"op"].decode()
    tenant = fields[b"tenant"].decode()
    if op == "put":
        return ChangeEvent(
            "put", tenant, EntryId(fields[b"id"].decode()),
            PartitionKey(fields[b"partition"].decode()), fields[b"prompt"].decode(),
            np.frombuffer(fields[b"vec"], dtype=np.float32).copy(),
            fields.get(b"emb", b"").decode(),
        )  # fmt: skip
    if op == "delete":
        return ChangeEvent("delete", tenant, EntryId(fields[b"id"].decode()))
    return ChangeEvent("flush", tenant)
