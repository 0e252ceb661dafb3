"""Semantic-cache capacity per tenant: entries and bytes, eviction inside the overflowing tenant.

Policy
------
* A tenant holds at most ``max_entries`` entries and ``max_bytes`` bytes, where an
  entry's size is its prompt, its answer's JSON and its embedding (:func:`entry_size`).
* Defaults come from :class:`~proxy.semantic.store.StoreConfig`
  (``capacity_per_tenant``, ``bytes_per_tenant``; None = no byte limit); the gateway
  sets a tenant's own limits from its policy (``kvtoll tenant policy NAME
  --semantic-max-entries N --semantic-max-bytes B``) with each of its requests
  (:meth:`CapacityTable.set`), so a change applies within the key cache's 5 s.
* A put past either limit evicts *that tenant's* least recently used entries until
  both hold again; no other tenant's entry is ever evicted for it. An entry larger
  than the tenant's whole byte limit is evicted at once (never kept).

Stores own the byte counts (:class:`ByteLedger` in process; a Redis hash in
:mod:`proxy.semantic.redis_store`) and call :meth:`CapacityTable.over` to decide.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol


class CacheEntry(Protocol):
    """What sizing needs of a :class:`proxy.semantic.store.CacheEntry`."""

    @property
    def tenant_id(self) -> str: ...

    @property
    def prompt(self) -> str: ...

    @property
    def answer(self) -> dict[str, Any]: ...

    @property
    def vector(self) -> Any: ...

MAX_TENANTS = 100_000  # overrides kept; past it the table starts again from defaults


@dataclass(frozen=True)
class TenantCapacity:
    """A tenant's own limits; None = the store's default."""

    max_entries: int | None = None
    max_bytes: int | None = None


class CapacityTable:
    """Each tenant's semantic capacity (defaults plus per-tenant overrides)."""

    def __init__(self, default_entries: int, default_bytes: int | None = None) -> None:
        if default_entries < 1 or (default_bytes is not None and default_bytes < 1):
            raise ValueError("capacity defaults must be positive")
        self.default_entries = default_entries
        self.default_bytes = default_bytes
        self._overrides: dict[str, TenantCapacity] = {}

    def set(self, tenant_id: str, capacity: TenantCapacity) -> None:
        """Apply a tenant's policy (both None: back to the defaults)."""
        if capacity == TenantCapacity():
            self._overrides.pop(tenant_id, None)
            return
        if len(self._overrides) >= MAX_TENANTS and tenant_id not in self._overrides:
            self._overrides.clear()
        self._overrides[tenant_id] = capacity

    def limits(self, tenant_id: str) -> tuple[int, int | None]:
        """(max entries, max bytes or None) for ``tenant_id``."""
        own = self._overrides.get(tenant_id, TenantCapacity())
        entries = own.max_entries if own.max_entries is not None else self.default_entries
        return entries, own.max_bytes if own.max_bytes is not None else self.default_bytes

    def over(self, tenant_id: str, num_entries: int, num_bytes: int) -> bool:
        """Whether a tenant holding this much must evict."""
        max_entries, max_bytes = self.limits(tenant_id)
        return num_entries > max_entries or (max_bytes is not None and num_bytes > max_bytes)


class ByteLedger:
    """Bytes each tenant's entries take, kept by the in-process store that holds them."""

    def __init__(self) -> None:
        self._bytes: dict[str, int] = {}

    def get(self, tenant_id: str) -> int:
        return self._bytes.get(tenant_id, 0)

    def add(self, entry: CacheEntry) -> None:
        self._bytes[entry.tenant_id] = self.get(entry.tenant_id) + entry_size(entry)

    def remove(self, entry: CacheEntry) -> None:
        left = self.get(entry.tenant_id) - entry_size(entry)
        if left > 0:
            self._bytes[entry.tenant_id] = left
        else:
            self._bytes.pop(entry.tenant_id, None)

    def drop(self, tenant_id: str) -> None:
        self._bytes.pop(tenant_id, None)


def entry_size(entry: CacheEntry) -> int:
    """Bytes an entry takes: UTF-8 prompt, answer JSON and the embedding's float32s."""
    answer = json.dumps(entry.answer, separators=(",", ":"))
    return len(entry.prompt.encode()) + len(answer.encode()) + 4 * int(entry.vector.size)
