"""Host tier: encoded blocks in memory per tenant, optionally spilling to a directory.

Policy (per-tenant quotas, eviction confined to the tenant that overflows):

* Each tenant (tenant salt; ``None`` = untenanted traffic) keeps an LRU of its blocks.
* ``tenant_cap_bytes`` caps one tenant's bytes in memory; ``capacity_bytes`` caps all.
* Putting a block for tenant T evicts T's own least recently used blocks until T is
  under its cap and the whole tier under its capacity. If T alone cannot make room
  (the rest of the tier is other tenants' blocks), the new block is not kept: another
  tenant's traffic never evicts T's blocks, and T never evicts theirs.
* With ``spill_dir``, a block evicted from memory is written to
  ``<spill_dir>/<salt hex>/<hash hex>`` under the same rules with ``spill_bytes``
  (tenant cap: the same fraction of it as in memory); a disk hit is read back, never
  trusted: the caller decodes it with its checksum.
* Each block remembers where it came from (:meth:`HostTier.from_shared`): this
  worker's own eviction, or a prefetch from the shared store, so the usage and the
  ledger can say which tier served a prompt's cached tokens.

Thread-safe (one lock): the offloader thread writes, the step thread and the
prefetching threads read.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from engine.kv.hashing import BlockHash, TenantSalt

Tenant = TenantSalt | None


@dataclass
class TierStats:
    """Counters of one tier (what ``/metrics`` shows)."""

    hits: int = 0
    misses: int = 0
    stores: int = 0
    dropped: int = 0  # not kept: the tenant's quota was full of pinned-by-rule blocks
    evictions: int = 0
    corrupt: int = 0


class _Lru:
    """One budgeted set of per-tenant LRUs (memory or disk)."""

    def __init__(self, capacity: int, tenant_cap: int) -> None:
        self.capacity = capacity
        self.tenant_cap = tenant_cap
        self.bytes = 0
        self.by_tenant: dict[Tenant, OrderedDict[BlockHash, int]] = {}
        self.tenant_bytes: dict[Tenant, int] = {}

    def fits_after_evicting(self, tenant: Tenant, size: int) -> list[BlockHash] | None:
        """The tenant's blocks to evict (oldest first) for ``size`` more bytes; None if
        even all of them would not make room."""
        if size > self.tenant_cap:
            return None
        lru = self.by_tenant.get(tenant, OrderedDict())
        mine = self.tenant_bytes.get(tenant, 0)
        need_tenant = mine + size - self.tenant_cap
        need_total = self.bytes + size - self.capacity
        need = max(need_tenant, need_total, 0)
        victims: list[BlockHash] = []
        freed = 0
        for h, n in lru.items():
            if freed >= need:
                break
            victims.append(h)
            freed += n
        return victims if freed >= need else None

    def add(self, tenant: Tenant, h: BlockHash, size: int) -> None:
        self.by_tenant.setdefault(tenant, OrderedDict())[h] = size
        self.tenant_bytes[tenant] = self.tenant_bytes.get(tenant, 0) + size
        self.bytes += size

    def remove(self, tenant: Tenant, h: BlockHash) -> int:
        size = self.by_tenant[tenant].pop(h)
        self.tenant_bytes[tenant] -= size
        self.bytes -= size
        return size

    def has(self, tenant: Tenant, h: BlockHash) -> bool:
        return h in self.by_tenant.get(tenant, {})


class HostTier:
    """Encoded blocks by (tenant, hash) within byte budgets; see the module header."""

    def __init__(
        self,
        capacity_bytes: int,
        tenant_cap_bytes: int | None = None,
        spill_dir: Path | None = None,
        spill_bytes: int = 0,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        cap = tenant_cap_bytes or capacity_bytes
        self._mem = _Lru(capacity_bytes, min(cap, capacity_bytes))
        self._data: dict[tuple[Tenant, BlockHash], bytes] = {}
        self._shared_origin: set[tuple[Tenant, BlockHash]] = set()  # put by a prefetch
        self._disk: _Lru | None = None
        self._spill_dir = spill_dir
        if spill_dir is not None and spill_bytes > 0:
            share = self._mem.tenant_cap / capacity_bytes
            self._disk = _Lru(spill_bytes, max(1, int(spill_bytes * share)))
            spill_dir.mkdir(parents=True, exist_ok=True)
        self.stats = TierStats()
        self.disk_stats = TierStats()
        self._lock = threading.Lock()

    @property
    def num_bytes(self) -> int:
        return self._mem.bytes

    @property
    def num_disk_bytes(self) -> int:
        return self._disk.bytes if self._disk else 0

    def tenant_bytes(self, tenant: Tenant) -> int:
        with self._lock:
            return self._mem.tenant_bytes.get(tenant, 0)

    def contains(self, tenant: Tenant, h: BlockHash) -> bool:
        with self._lock:
            on_disk = self._disk is not None and self._disk.has(tenant, h)
            return on_disk or self._mem.has(tenant, h)

    def from_shared(self, tenant: Tenant, h: BlockHash) -> bool:
        """Whether (tenant, hash) was put here by a prefetch from the shared store."""
        with self._lock:
            return (tenant, h) in self._shared_origin

    def put(self, tenant: Tenant, h: BlockHash, data: bytes, *, shared: bool = False) -> bool:
        """Keep ``data`` for (tenant, hash); False if the tenant's quota cannot hold it.
        ``shared``: it came from the shared store (see :meth:`from_shared`)."""
        with self._lock:
            if self._mem.has(tenant, h):
                self._mem.by_tenant[tenant].move_to_end(h)
                return True
            victims = self._mem.fits_after_evicting(tenant, len(data))
            if victims is None:
                self.stats.dropped += 1
                return False
            for v in victims:
                self._mem.remove(tenant, v)
                self.stats.evictions += 1
                self._spill(tenant, v, self._data.pop((tenant, v)))
                if self._disk is None or not self._disk.has(tenant, v):
                    self._shared_origin.discard((tenant, v))
            self._mem.add(tenant, h, len(data))
            self._data[(tenant, h)] = data
            if shared:
                self._shared_origin.add((tenant, h))
            else:
                self._shared_origin.discard((tenant, h))
            self.stats.stores += 1
            return True

    def get(self, tenant: Tenant, h: BlockHash) -> bytes | None:
        """The bytes for (tenant, hash), refreshing its LRU position; None on a miss."""
        with self._lock:
            data = self._data.get((tenant, h))
            if data is not None:
                self._mem.by_tenant[tenant].move_to_end(h)
                self.stats.hits += 1
                return data
            if self._disk is None or not self._disk.has(tenant, h):
                self.stats.misses += 1
                return None
            path = self._path(tenant, h)
        try:
            data = path.read_bytes()
        except OSError:
            data = None
        with self._lock:
            if data is None:
                self.disk_stats.misses += 1
                self.stats.misses += 1
                return None
            self.disk_stats.hits += 1
            self.stats.hits += 1
            return data

    def discard(self, tenant: Tenant, h: BlockHash) -> None:
        """Forget a block (it failed its checksum)."""
        with self._lock:
            self.stats.corrupt += 1
            self._shared_origin.discard((tenant, h))
            if self._mem.has(tenant, h):
                self._mem.remove(tenant, h)
                self._data.pop((tenant, h), None)
            if self._disk is not None and self._disk.has(tenant, h):
                self._disk.remove(tenant, h)
                with contextlib.suppress(OSError):
                    self._path(tenant, h).unlink()

    def _spill(self, tenant: Tenant, h: BlockHash, data: bytes) -> None:
        disk = self._disk
        if disk is None or disk.has(tenant, h):
            return
        victims = disk.fits_after_evicting(tenant, len(data))
        if victims is None:
            self.disk_stats.dropped += 1
            return
        for v in victims:
            disk.remove(tenant, v)
            self.disk_stats.evictions += 1
            if not self._mem.has(tenant, v):
                self._shared_origin.discard((tenant, v))
            with contextlib.suppress(OSError):
                self._path(tenant, v).unlink()
        path = self._path(tenant, h)
        try:
            path.parent.mkdir(exist_ok=True)
            path.write_bytes(data)
        except OSError:
            self.disk_stats.dropped += 1
            return
        disk.add(tenant, h, len(data))
        self.disk_stats.stores += 1

    def _path(self, tenant: Tenant, h: BlockHash) -> Path:
        assert self._spill_dir is not None
        return self._spill_dir / (tenant.hex() if tenant else "-") / h.hex()
