"""Shared tier in Redis: one binary value per block, with a TTL, under the block's key.

Keys: ``kvtoll:kvtier:<model>:<tenant salt hex>:<block hash hex>`` (see
:meth:`BlockKey.redis_key`); values: :mod:`engine.kv.tier.codec` bytes, checked on
load. Writes are ``SET .. EX ttl``; when Redis is at ``maxmemory`` it refuses or
evicts per its own policy (a refused write counts as ``dropped``; nothing retries).

Faults: every call has ``timeout_s`` (connect and socket). After a failure the store
is skipped for ``backoff_s`` so that a store that is down or blackholed costs one
timeout per ``backoff_s``, not one per request; the caller recomputes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import redis

from engine.kv.tier.codec import BlockKey

log = logging.getLogger(__name__)
KEY_PREFIX = "kvtoll:kvtier"


@dataclass
class SharedStats:
    hits: int = 0
    misses: int = 0
    stores: int = 0
    dropped: int = 0
    errors: int = 0
    skipped: int = 0  # calls not made while backing off after an error


class RedisBlockStore:
    """``put_many`` / ``get_many`` of encoded blocks; never raises on a store fault."""

    def __init__(
        self,
        url: str,
        ttl_s: int = 3600,
        timeout_s: float = 0.25,
        backoff_s: float = 5.0,
        key_prefix: str = KEY_PREFIX,
    ) -> None:
        if ttl_s <= 0 or timeout_s <= 0:
            raise ValueError("ttl_s and timeout_s must be positive")
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self.ttl_s = ttl_s
        self.key_prefix = key_prefix
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self.stats = SharedStats()
        self._down_until = 0.0
        self._lock = threading.Lock()

    def _available(self) -> bool:
        with self._lock:
            if time.monotonic() < self._down_until:
                self.stats.skipped += 1
                return False
            return True

    def _failed(self, exc: Exception) -> None:
        with self._lock:
            self.stats.errors += 1
            self._down_until = time.monotonic() + self.backoff_s
        log.warning("shared KV tier unavailable for %.0fs: %s", self.backoff_s, exc)

    def put_many(self, items: Sequence[tuple[BlockKey, bytes]]) -> int:
        """Store each (key, bytes) with the TTL; the number stored."""
        if not items or not self._available():
            return 0
        pipe = self._client.pipeline(transaction=False)
        for key, data in items:
            pipe.set(key.redis_key(self.key_prefix), data, ex=self.ttl_s)
        try:
            results = pipe.execute(raise_on_error=False)
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            self._failed(exc)
            return 0
        stored = sum(1 for r in results if r is True)
        with self._lock:
            self.stats.stores += stored
            self.stats.dropped += len(items) - stored  # e.g. OOM at maxmemory
        return stored

    def get_many(self, keys: Sequence[BlockKey]) -> list[bytes | None]:
        """The bytes for each key (None: missing or the store is unavailable)."""
        if not keys:
            return []
        if not self._available():
            return [None] * len(keys)
        try:
            values = self._client.mget([k.redis_key(self.key_prefix) for k in keys])
        except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError, OSError) as exc:
            self._failed(exc)
            return [None] * len(keys)
        out = [v if isinstance(v, bytes) else None for v in values]
        with self._lock:
            hits = sum(1 for v in out if v is not None)
            self.stats.hits += hits
            self.stats.misses += len(out) - hits
        return out

    def close(self) -> None:
        self._client.close()
