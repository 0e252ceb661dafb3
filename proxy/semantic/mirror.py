"""This process's searchable copy of the cache: one vector index per (tenant, partition).

Entries get a process-local int64 id (FAISS ids) on first sight; a slot keeps what
verification needs (entry id, tenant, partition, prompt text) so a lookup touches the
store only for the winning candidate. An index is dropped when its last entry goes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from proxy.semantic.index import VectorIndex
from proxy.semantic.keys import PartitionKey
from proxy.semantic.store import EntryId

IndexFactory = Callable[[int], VectorIndex]


@dataclass(frozen=True)
class Slot:
    """A mirrored entry."""

    entry_id: EntryId
    tenant_id: str
    partition: PartitionKey
    prompt: str


class Mirror:
    """Vector indexes per partition plus the slot of every mirrored entry."""

    def __init__(self, dim: int, index_factory: IndexFactory) -> None:
        self._dim = dim
        self._index_factory = index_factory
        self._partitions: dict[tuple[str, PartitionKey], VectorIndex] = {}
        self._slots: dict[int, Slot] = {}
        self._int_ids: dict[EntryId, int] = {}
        self._next_int = 0

    def count(self, tenant_id: str | None = None) -> int:
        """Mirrored entries (one tenant's, or all)."""
        if tenant_id is None:
            return len(self._slots)
        return sum(1 for s in self._slots.values() if s.tenant_id == tenant_id)

    def index(self, tenant_id: str, partition: PartitionKey) -> VectorIndex | None:
        return self._partitions.get((tenant_id, partition))

    def search(
        self, tenant_id: str, partition: PartitionKey, vector: np.ndarray, k: int
    ) -> list[tuple[Slot, float]]:
        """Up to ``k`` nearest entries of one partition, best first."""
        index = self._partitions.get((tenant_id, partition))
        found = index.search(vector, k) if index is not None else []
        return [(self._slots[i], sim) for i, sim in found if i in self._slots]

    def slot_of(self, entry_id: EntryId) -> Slot | None:
        int_id = self._int_ids.get(entry_id)
        return None if int_id is None else self._slots.get(int_id)

    def add(self, slot: Slot, vector: np.ndarray) -> None:
        """Mirror an entry (no-op if it already is)."""
        if slot.entry_id in self._int_ids:
            return
        int_id = self._next_int
        self._next_int += 1
        key = (slot.tenant_id, slot.partition)
        index = self._partitions.get(key)
        if index is None:
            index = self._partitions[key] = self._index_factory(self._dim)
        index.add(np.array([int_id], dtype=np.int64), vector.reshape(1, -1))
        self._slots[int_id] = slot
        self._int_ids[slot.entry_id] = int_id

    def remove(self, entry_id: EntryId) -> None:
        """Forget an entry (no-op if unknown)."""
        int_id = self._int_ids.pop(entry_id, None)
        if int_id is None:
            return
        slot = self._slots.pop(int_id)
        key = (slot.tenant_id, slot.partition)
        index = self._partitions.get(key)
        if index is not None:
            index.remove(np.array([int_id], dtype=np.int64))
            if len(index) == 0:
                del self._partitions[key]

    def remove_tenant(self, tenant_id: str) -> None:
        """Forget every entry of one tenant."""
        for entry_id in [s.entry_id for s in self._slots.values() if s.tenant_id == tenant_id]:
            self.remove(entry_id)
