"""Tenant shares of the prefix cache: who owns each cached block, and whose block to evict.

Policy (the pool's eviction choice, :meth:`TenantShares.choose_victim`):

* Every cached block belongs to the tenant whose salt made it (``owner``; ``None`` for
  unsalted requests, which form one tenant of their own). Each tenant keeps its *free*
  cached blocks in its own LRU queue (head = freed longest ago); a block's ``freed_at``
  stamp orders blocks across queues, so with no reservations the choice is exactly one
  global LRU.
* ``reserved_blocks`` (R): while a tenant holds at most R cached blocks (free or in use),
  none of them is evicted for another tenant. The tenant itself may always evict its own.
* ``max_blocks`` (M, optional, >= R): a tenant never holds more than M cached blocks; a
  block that would exceed it first evicts the tenant's own least recently used free
  block, and stays uncached if there is none.
* Running sequences come first: a *running* sequence that needs a block and finds no
  other may take a reserved one (``use_reserved``); reservations bound the cache, never
  admission to the batch. The scheduler admits a *waiting* sequence into reserved blocks
  only when nothing runs (so every sequence still fits an idle pool).

Victim choice for tenant T: the free cached block with the oldest ``freed_at`` among the
queues of tenants above their reservation (T included); else T's own least recently used
(within its reservation: a tenant may evict its own for itself); else, if
``use_reserved``, the oldest of any queue. Cost O(number of tenants with free cached
blocks).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field

from engine.api import KVShare, TenantCacheLoad
from engine.kv.free_queue import FreeBlockQueue, KVBlock
from engine.kv.hashing import TenantSalt

Owner = TenantSalt | None
NO_SHARE = KVShare(tenant="", reserved_blocks=0, max_blocks=None)


@dataclass
class TenantCache:
    """One tenant's part of the prefix cache, and its counters since start."""

    share: KVShare = NO_SHARE
    free: FreeBlockQueue = field(default_factory=lambda: FreeBlockQueue([]))
    num_cached: int = 0  # blocks with this tenant's hash, free or in use
    num_query_blocks: int = 0  # prompt blocks looked up at admission
    num_hit_blocks: int = 0  # of those, found in the cache
    num_evicted: int = 0  # cached blocks of this tenant dropped (any reason)

    def load(self) -> TenantCacheLoad:
        share = self.share
        return TenantCacheLoad(share.tenant, share.reserved_blocks, share.max_blocks,
                               self.num_cached, self.num_query_blocks, self.num_hit_blocks,
                               self.num_evicted)

    def evictable_by_others(self) -> int:
        """Free cached blocks another tenant may take without breaking the reservation."""
        return min(len(self.free), max(0, self.num_cached - self.share.reserved_blocks))


class TenantShares:
    """Per-tenant cached-block queues, counts and shares; owned by one :class:`BlockPool`."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._tenants: dict[Owner, TenantCache] = {}
        self._num_reserving = 0  # tenants with reserved_blocks > 0 (fast path when 0)
        self._clock = 0

    def get(self, owner: Owner) -> TenantCache:
        """The tenant's state (created empty on first use)."""
        state = self._tenants.get(owner)
        if state is None:
            state = self._tenants[owner] = TenantCache()
        return state

    def items(self) -> Iterator[tuple[Owner, TenantCache]]:
        return iter(list(self._tenants.items()))

    @property
    def any_reserved(self) -> bool:
        return self._num_reserving > 0

    def set_share(self, owner: Owner, share: KVShare) -> TenantCache:
        """Apply ``share`` to ``owner``; ValueError for one this pool cannot honour."""
        check_share(share, self.num_blocks)
        state = self.get(owner)
        self._num_reserving += (share.reserved_blocks > 0) - (state.share.reserved_blocks > 0)
        state.share = share
        return state

    def link_free(self, block: KVBlock) -> TenantCache:
        """A cached block's ref count fell to 0: it joins its owner's LRU tail."""
        self._clock += 1
        block.freed_at = self._clock
        state = self.get(block.owner)
        state.free.append(block)
        return state

    def unlink_free(self, block: KVBlock) -> None:
        """A free cached block leaves its owner's queue (hit or eviction)."""
        self.get(block.owner).free.remove(block)

    def loads(self) -> tuple[TenantCacheLoad, ...]:
        """Every tenant's counters, named by its share (salted tenants never sent one are
        summed as ``""``; unsalted requests are ``"-"``)."""
        named: dict[str, TenantCacheLoad] = {}
        for owner, state in self.items():
            load = state.load()
            label = load.tenant or ("-" if owner is None else "")
            load = dataclasses.replace(load, tenant=label)
            seen = named.get(label)
            named[label] = load if seen is None else _add(seen, load)
        return tuple(named[k] for k in sorted(named))

    def num_free_cached(self) -> int:
        return sum(len(t.free) for t in self._tenants.values())

    def available_to(self, owner: Owner) -> int:
        """Free cached blocks ``owner`` may take without touching other reservations."""
        total = 0
        for other, state in self._tenants.items():
            total += len(state.free) if other == owner else state.evictable_by_others()
        return total

    def choose_victim(self, owner: Owner, use_reserved: bool) -> KVBlock | None:
        """The free cached block to evict so that ``owner`` gets a block (see module doc)."""
        best: KVBlock | None = None
        own: KVBlock | None = None
        fallback: KVBlock | None = None
        for other, state in self._tenants.items():
            head = state.free.head
            if head is None:
                continue
            if state.num_cached > state.share.reserved_blocks:
                if best is None or head.freed_at < best.freed_at:
                    best = head
            elif other == owner:
                own = head
            elif fallback is None or head.freed_at < fallback.freed_at:
                fallback = head
        if best is not None:
            return best
        if own is not None:
            return own
        return fallback if use_reserved else None

    def cached_in_order(self) -> Iterator[KVBlock]:
        """Every free cached block, oldest ``freed_at`` first (tests, reset)."""
        blocks = [b for t in self._tenants.values() for b in t.free]
        return iter(sorted(blocks, key=lambda b: b.freed_at))


def _add(a: TenantCacheLoad, b: TenantCacheLoad) -> TenantCacheLoad:
    return dataclasses.replace(
        a, reserved_blocks=a.reserved_blocks + b.reserved_blocks,
        cached_blocks=a.cached_blocks + b.cached_blocks,
        query_blocks=a.query_blocks + b.query_blocks, hit_blocks=a.hit_blocks + b.hit_blocks,
        evicted_blocks=a.evicted_blocks + b.evicted_blocks,
    )


def check_share(share: KVShare, num_blocks: int) -> None:
    """ValueError unless ``share`` fits a pool of ``num_blocks`` blocks."""
    reserved, cap = share.reserved_blocks, share.max_blocks
    if isinstance(reserved, bool) or not isinstance(reserved, int) or reserved < 0:
        raise ValueError(f"kv reserved_blocks must be a non-negative integer, got {reserved!r}")
    if reserved > num_blocks:
        raise ValueError(
            f"kv reservation of {reserved} blocks exceeds this worker's pool of "
            f"{num_blocks} blocks"
        )
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < reserved):
        raise ValueError(f"kv max_blocks must be an integer >= reserved_blocks, got {cap!r}")
