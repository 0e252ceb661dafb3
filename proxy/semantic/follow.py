"""This process's FAISS mirror kept in step with the entry store.

:meth:`Follower.load` rebuilds the mirror from a store snapshot (on start);
:meth:`Follower.sync` applies the changes other replicas made since (the store's
change feed); :meth:`Follower.run` does that in a loop, sweeping expired entries every
``sweep_interval_s``; a store failure counts in ``stats.store_errors`` and the loop
waits a second before it tries again. Only entries whose vector this process's embedder
wrote (``CacheEntry.embedder == embedder``) are mirrored: a replica running another
model (or an entry from before the field) is skipped and counted in
``stats.other_embedder``, so two models' vectors never meet in one index.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from proxy.semantic.keys import PartitionKey
from proxy.semantic.mirror import Mirror, Slot
from proxy.semantic.stats import SemanticStats
from proxy.semantic.store import ChangeEvent, EntryId, EntryStore


class Follower:
    """Mirror upkeep for one :class:`~proxy.semantic.service.SemanticCache`."""

    def __init__(self, store: EntryStore, mirror: Mirror, stats: SemanticStats, embedder: str
                 ) -> None:  # fmt: skip
        self._store = store
        self._embedder = embedder
        self._mirror = mirror
        self._stats = stats
        self._cursor: str | None = None

    def add(self, entry_id: EntryId, tenant_id: str, partition: PartitionKey, prompt: str,
            vector: np.ndarray) -> None:  # fmt: skip
        self._mirror.add(Slot(entry_id, tenant_id, partition, prompt), vector)

    def apply(self, event: ChangeEvent) -> None:
        """Mirror one change made elsewhere."""
        if event.op == "flush":
            self._mirror.remove_tenant(event.tenant_id)
        elif event.op == "delete" and event.entry_id is not None:
            self._mirror.remove(event.entry_id)
        elif event.op == "put" and event.entry_id and event.partition and event.vector is not None:
            if event.embedder != self._embedder:
                self._stats.other_embedder += 1
                return
            self.add(event.entry_id, event.tenant_id, event.partition, event.prompt, event.vector)

    async def load(self) -> int:
        """Rebuild the mirror from the store; returns entries mirrored (this embedder's)."""
        cursor, entries = await self._store.snapshot()
        mine = [e for e in entries if e.embedder == self._embedder]
        self._stats.other_embedder += len(entries) - len(mine)
        for e in mine:
            self.add(e.entry_id, e.tenant_id, e.partition, e.prompt, e.vector)
        self._cursor = cursor
        return len(mine)

    async def sync(self, block_ms: int = 0) -> int:
        """Apply pending changes from other replicas; returns how many."""
        self._cursor, events = await self._store.changes(self._cursor, block_ms)
        for event in events:
            self.apply(event)
        return len(events)

    async def sweep(self) -> int:
        """Delete expired entries from the store and the mirror."""
        removed = await self._store.expire()
        for _, entry_id in removed:
            self._mirror.remove(entry_id)
        return len(removed)

    async def run(self, sync_block_ms: int, sweep_interval_s: float) -> None:
        """Follow the feed and sweep, until cancelled."""
        last_sweep = time.monotonic()
        while True:
            try:
                await asyncio.sleep(0)  # always yield, whatever the store does
                await self.sync(sync_block_ms)
                if time.monotonic() - last_sweep >= sweep_interval_s:
                    last_sweep = time.monotonic()
                    await self.sweep()
            except asyncio.CancelledError:
                raise
            except Exception:
                self._stats.store_errors += 1
                await asyncio.sleep(1.0)
