"""Semantic-cache entries per tenant: TTL, capacity and LRU eviction.

Policy
------
* An entry lives until ``expires_at = created_at + ttl_s`` (``StoreConfig.ttl_s``);
  an expired entry is never returned and is deleted when seen or swept.
* Each tenant holds at most ``capacity_per_tenant`` entries (and ``bytes_per_tenant``
  bytes), or its own limits (:mod:`proxy.semantic.capacity`); a put past them evicts
  that tenant's least recently used ones (recency = last hit, or creation if never hit).
* Tenants never share entries: every operation is scoped by tenant id.
* Evidence for the error bound (:mod:`proxy.semantic.bound`) lives with the entry
  (gone with it) and, summed, with the tenant (kept): :meth:`EntryStore.observe`
  adds one observation to both, :meth:`EntryStore.evidence` reads them.

:class:`InMemoryStore` is the single-process default. :mod:`proxy.semantic.redis_store`
holds entries in Redis so that every replica serves every replica's entries; stores
also expose a change feed (:meth:`EntryStore.changes`) that keeps each replica's
FAISS mirror in sync. Times are seconds from an injected clock.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal, NewType, Protocol

import numpy as np
import numpy.typing as npt

from proxy.semantic.bound import Evidence
from proxy.semantic.capacity import ByteLedger, CapacityTable
from proxy.semantic.keys import PartitionKey

EntryId = NewType("EntryId", str)
Clock = Callable[[], float]


@dataclass(frozen=True)
class StoreConfig:
    """Per-tenant limits."""

    ttl_s: float = 7 * 24 * 3600.0
    capacity_per_tenant: int = 100_000
    request_memory_s: float = 24 * 3600.0  # how long request id -> entry id is kept (feedback)
    bytes_per_tenant: int | None = None  # default byte limit per tenant (None: none)

    def __post_init__(self) -> None:
        if self.ttl_s <= 0 or self.capacity_per_tenant < 1:
            raise ValueError("ttl_s must be > 0 and capacity_per_tenant >= 1")
        if self.bytes_per_tenant is not None and self.bytes_per_tenant < 1:
            raise ValueError("bytes_per_tenant must be >= 1 or unset")

    def capacity_table(self) -> CapacityTable:
        return CapacityTable(self.capacity_per_tenant, self.bytes_per_tenant)


@dataclass(frozen=True)
class CacheEntry:
    """One cached answer. ``answer`` is the full response JSON needed to replay it."""

    entry_id: EntryId
    tenant_id: str
    partition: PartitionKey
    prompt: str
    answer: dict[str, Any]
    vector: npt.NDArray[np.float32] = field(compare=False, repr=False)
    created_at: float
    expires_at: float
    last_hit_at: float
    hit_count: int = 0
    # The embedder that wrote ``vector`` (``Embedder.name``; "" from before the field):
    # a replica mirrors only its own embedder's vectors (proxy.semantic.follow).
    embedder: str = ""


@dataclass(frozen=True)
class ChangeEvent:
    """A change another replica made: mirror it in the local index."""

    op: Literal["put", "delete", "flush"]
    tenant_id: str
    entry_id: EntryId | None = None
    partition: PartitionKey | None = None
    prompt: str = ""
    vector: npt.NDArray[np.float32] | None = field(default=None, compare=False, repr=False)
    embedder: str = ""  # of a put: the embedder that wrote ``vector``


class EntryStore(Protocol):
    """Where entries live. Every method may raise on a backend failure (the service
    turns that into a miss)."""

    capacity: CapacityTable  # each tenant's limits (proxy.semantic.capacity)

    async def put(self, entry: CacheEntry) -> list[EntryId]:
        """Store ``entry``; returns the ids evicted to stay within capacity."""
        ...

    async def get(self, tenant_id: str, entry_id: EntryId) -> CacheEntry | None: ...

    async def record_hit(self, tenant_id: str, entry_id: EntryId) -> CacheEntry | None:
        """Bump last hit / hit count; the updated entry, or None if gone or expired."""
        ...

    async def delete(self, tenant_id: str, entry_id: EntryId) -> bool: ...

    async def flush(self, tenant_id: str) -> int: ...

    async def expire(self) -> list[tuple[str, EntryId]]:
        """Delete every expired entry; returns (tenant, id) of those removed."""
        ...

    async def snapshot(self) -> tuple[str | None, list[CacheEntry]]:
        """(feed cursor, every live entry): rebuild a mirror, then follow from the cursor."""
        ...

    async def changes(
        self, cursor: str | None, block_ms: int
    ) -> tuple[str | None, list[ChangeEvent]]:
        """Other replicas' changes after ``cursor`` (waits up to ``block_ms``)."""
        ...

    async def remember_request(
        self, tenant_id: str, request_id: str, entry_id: EntryId, score: float | None = None
    ) -> None:
        """Remember which entry answered a request, and at which verifier score."""
        ...

    async def entry_for_request(self, tenant_id: str, request_id: str) -> EntryId | None: ...

    async def served_for_request(
        self, tenant_id: str, request_id: str
    ) -> tuple[EntryId, float | None] | None:
        """(entry id, score) that answered a request, or None."""
        ...

    async def observe(
        self, tenant_id: str, entry_id: EntryId | None, score: float, correct: bool
    ) -> None:
        """Add one observation to the entry's evidence (if it still exists; None: the
        tenant's only) and to the tenant's."""
        ...

    async def evidence(
        self, tenant_id: str, entry_ids: list[EntryId]
    ) -> tuple[Evidence, list[Evidence]]:
        """The tenant's evidence and each entry's (empty for an unknown one)."""
        ...

    async def aclose(self) -> None: ...


class InMemoryStore:
    """Single-process store: one LRU-ordered dict per tenant."""

    def __init__(self, config: StoreConfig | None = None, clock: Clock = time.time) -> None:
        self._config = config or StoreConfig()
        self._clock = clock
        self._tenants: dict[str, OrderedDict[EntryId, CacheEntry]] = {}
        self._requests: dict[tuple[str, str], tuple[EntryId, float, float | None]] = {}
        self._entry_evidence: dict[tuple[str, EntryId], Evidence] = {}
        self._tenant_evidence: dict[str, Evidence] = {}
        self.capacity = self._config.capacity_table()
        self._bytes = ByteLedger()

    @property
    def config(self) -> StoreConfig:
        return self._config

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._tenants.values())

    async def put(self, entry: CacheEntry) -> list[EntryId]:
        entries = self._tenants.setdefault(entry.tenant_id, OrderedDict())
        old = entries.get(entry.entry_id)
        if old is not None:
            self._bytes.remove(old)
        entries[entry.entry_id] = entry
        entries.move_to_end(entry.entry_id)
        self._bytes.add(entry)
        evicted: list[EntryId] = []
        tenant = entry.tenant_id
        while entries and self.capacity.over(tenant, len(entries), self._bytes.get(tenant)):
            victim_id, victim = entries.popitem(last=False)
            self._bytes.remove(victim)
            self._entry_evidence.pop((tenant, victim_id), None)
            evicted.append(victim_id)
        return evicted

    async def get(self, tenant_id: str, entry_id: EntryId) -> CacheEntry | None:
        entries = self._tenants.get(tenant_id)
        entry = entries.get(entry_id) if entries else None
        if entry is None or entries is None:
            return None
        if entry.expires_at <= self._clock():
            self._bytes.remove(entries.pop(entry_id))
            self._entry_evidence.pop((tenant_id, entry_id), None)
            return None
        return entry

    async def record_hit(self, tenant_id: str, entry_id: EntryId) -> CacheEntry | None:
        entry = await self.get(tenant_id, entry_id)
        if entry is None:
            return None
        updated = replace(entry, last_hit_at=self._clock(), hit_count=entry.hit_count + 1)
        entries = self._tenants[tenant_id]
        entries[entry_id] = updated
        entries.move_to_end(entry_id)
        return updated

    async def delete(self, tenant_id: str, entry_id: EntryId) -> bool:
        entries = self._tenants.get(tenant_id)
        gone = entries.pop(entry_id, None) if entries else None
        if gone is not None:
            self._bytes.remove(gone)
            self._entry_evidence.pop((tenant_id, entry_id), None)
        return gone is not None

    async def flush(self, tenant_id: str) -> int:
        entries = self._tenants.pop(tenant_id, None)
        self._bytes.drop(tenant_id)
        for entry_id in entries or ():
            self._entry_evidence.pop((tenant_id, entry_id), None)
        return len(entries) if entries else 0

    async def expire(self) -> list[tuple[str, EntryId]]:
        now = self._clock()
        removed: list[tuple[str, EntryId]] = []
        for tenant_id, entries in self._tenants.items():
            for entry_id in [i for i, e in entries.items() if e.expires_at <= now]:
                self._bytes.remove(entries.pop(entry_id))
                self._entry_evidence.pop((tenant_id, entry_id), None)
                removed.append((tenant_id, entry_id))
        return removed

    async def snapshot(self) -> tuple[str | None, list[CacheEntry]]:
        now = self._clock()
        live = [
            e for entries in self._tenants.values() for e in entries.values() if e.expires_at > now
        ]
        return None, live

    async def changes(
        self, cursor: str | None, block_ms: int
    ) -> tuple[str | None, list[ChangeEvent]]:
        # One process: the service already applied its own changes. Wait like a
        # blocking read would, so that a follower loop never spins.
        await asyncio.sleep(block_ms / 1000)
        return cursor, []

    async def remember_request(
        self, tenant_id: str, request_id: str, entry_id: EntryId, score: float | None = None
    ) -> None:
        now = self._clock()
        if len(self._requests) > 100_000:
            self._requests = {k: v for k, v in self._requests.items() if v[1] > now}
        until = now + self._config.request_memory_s
        self._requests[(tenant_id, request_id)] = (entry_id, until, score)

    async def entry_for_request(self, tenant_id: str, request_id: str) -> EntryId | None:
        served = await self.served_for_request(tenant_id, request_id)
        return served[0] if served else None

    async def served_for_request(
        self, tenant_id: str, request_id: str
    ) -> tuple[EntryId, float | None] | None:
        found = self._requests.get((tenant_id, request_id))
        return (found[0], found[2]) if found and found[1] > self._clock() else None

    async def observe(
        self, tenant_id: str, entry_id: EntryId | None, score: float, correct: bool
    ) -> None:
        tenant = self._tenant_evidence.get(tenant_id, Evidence())
        self._tenant_evidence[tenant_id] = tenant.add(score, correct)
        entries = self._tenants.get(tenant_id)
        if entry_id is not None and entries is not None and entry_id in entries:
            key = (tenant_id, entry_id)
            self._entry_evidence[key] = self._entry_evidence.get(key, Evidence()).add(
                score, correct
            )

    async def evidence(
        self, tenant_id: str, entry_ids: list[EntryId]
    ) -> tuple[Evidence, list[Evidence]]:
        empty = Evidence()
        return self._tenant_evidence.get(tenant_id, empty), [
            self._entry_evidence.get((tenant_id, e), empty) for e in entry_ids
        ]

    async def aclose(self) -> None:
        return None
