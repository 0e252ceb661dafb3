"""Block pool: every KV block, their ref counts, and the prefix-cache hash map.

Policy (automatic prefix caching, vLLM v1 style):

* A block is *cached* once it is full and its chained hash (see
  :mod:`engine.kv.hashing`) is registered in ``hash -> block``. Only full blocks are
  cached; the first block's hash carries the tenant salt.
* A block whose ref count drops to 0 goes to the free queue but keeps its hash, so a
  later request can still hit it. Cached free blocks join the *tail* (freed last =
  evicted last, i.e. LRU); blocks without a hash join the *head* so they are reused
  before any cached block is evicted.
* Allocation pops the head; if that block was cached, its hash is dropped (eviction)
  and a REMOVED event is emitted. Registering hashes emits a STORED event.
* Tenant shares: free blocks without a hash sit in one queue (``uncached``, reused
  first); free cached blocks sit in their owner tenant's LRU queue. Which cached block
  an allocation evicts is decided in one place, :meth:`TenantShares.choose_victim`
  (reservations, caps: :mod:`engine.kv.tenant_shares`); with no reservation set it is
  the least recently freed cached block of all, as with one global queue.
* Parameters: ``num_blocks`` (pool size), ``block_size`` (tokens per block).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from engine.api import KVEventKind, KVShare
from engine.kv.events import KVEventLog
from engine.kv.free_queue import BlockId, FreeBlockQueue, KVBlock
from engine.kv.hashing import BlockHash, TenantSalt
from engine.kv.tenant_shares import TenantCache, TenantShares


class BlockPool:
    """Owns all blocks; hands them out and takes them back by ref count."""

    def __init__(self, num_blocks: int, block_size: int, events: KVEventLog | None = None) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks={num_blocks}, block_size={block_size} must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [KVBlock(BlockId(i)) for i in range(num_blocks)]
        self.uncached = FreeBlockQueue(self.blocks)  # free blocks without a hash
        self.tenants = TenantShares(num_blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        self.events = events if events is not None else KVEventLog()
        # tier 2 (engine.kv.tier): told of each cached block before its hash is dropped
        self.on_evict: Callable[[KVBlock], None] | None = None
        self._num_free = num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0 (cached or not): all can be handed out."""
        return self._num_free

    def num_available(self, owner: TenantSalt | None, use_reserved: bool = True) -> int:
        """Free blocks an allocation for ``owner`` may take; without ``use_reserved``,
        other tenants' reserved cached blocks do not count."""
        if use_reserved or not self.tenants.any_reserved:
            return self._num_free
        return len(self.uncached) + self.tenants.available_to(owner)

    def free_blocks(self) -> Iterator[KVBlock]:
        """Every free block in eviction order when no reservation is set (tests)."""
        yield from self.uncached
        yield from self.tenants.cached_in_order()

    def set_share(self, owner: TenantSalt | None, share: KVShare) -> TenantCache:
        """Give ``owner`` (a tenant salt) this share; ValueError if the pool cannot hold
        it. A lowered cap evicts the tenant's least recently used free blocks."""
        state = self.tenants.set_share(owner, share)
        self._trim_to_cap(state)
        return state

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        """The cached block with this hash, or None."""
        return self.cached.get(block_hash)

    def allocate(
        self, num: int, owner: TenantSalt | None = None, use_reserved: bool = True
    ) -> list[KVBlock]:
        """Take ``num`` free blocks for ``owner``: never-cached ones first, then evicting
        the cached blocks :meth:`TenantShares.choose_victim` picks."""
        if num > self.num_available(owner, use_reserved):
            raise RuntimeError(f"asked for {num} blocks, only {self._num_free} free")
        out: list[KVBlock] = []
        for _ in range(num):
            block = self._take(owner, use_reserved)
            block.ref_cnt = 1
            out.append(block)
        self._num_free -= num
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Add one reference to each (prefix hit); free ones leave the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self._unlink_free(block)
                self._num_free -= 1
            block.ref_cnt += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference to each; pass them in eviction order (first = evicted first)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed with ref_cnt {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._num_free += 1
                if block.block_hash is None:
                    self.uncached.appendleft(block)
                else:
                    self._trim_to_cap(self.tenants.link_free(block))

    def cache_block(
        self,
        block: KVBlock,
        block_hash: BlockHash,
        token_ids: tuple[int, ...],
        owner: TenantSalt | None = None,
    ) -> bool:
        """Register a full block under ``block_hash`` for ``owner``; False if that hash is
        already cached or ``owner`` is at its cap with no free block of its own to drop."""
        if block.block_hash is not None:
            raise RuntimeError(f"block {block.block_id} is already cached")
        if len(token_ids) != self.block_size:
            raise RuntimeError(f"only full blocks are cached, got {len(token_ids)} tokens")
        if block_hash in self.cached:
            return False
        state = self.tenants.get(owner)
        cap = state.share.max_blocks
        if cap is not None and state.num_cached >= cap:
            if state.free.head is None:
                return False
            self._evict_to_uncached(state.free.head)
        block.block_hash = block_hash
        block.token_ids = token_ids
        block.owner = owner
        state.num_cached += 1
        self.cached[block_hash] = block
        return True

    def evict_all_free(self) -> int:
        """Drop the hash of every free cached block (reset the prefix cache); count them."""
        victims = list(self.tenants.cached_in_order())
        for block in victims:
            self._evict_to_uncached(block)
        return len(victims)

    def _take(self, owner: TenantSalt | None, use_reserved: bool) -> KVBlock:
        if self.uncached.head is not None:
            return self.uncached.popleft()
        victim = self.tenants.choose_victim(owner, use_reserved)
        if victim is None:
            raise RuntimeError("no evictable block although the count said there was one")
        self.tenants.unlink_free(victim)
        self._evict(victim)
        return victim

    def _trim_to_cap(self, state: TenantCache) -> None:
        """Evict the tenant's least recently used free blocks while it is over its cap
        (a cap lowered while its blocks were in use)."""
        cap = state.share.max_blocks
        while cap is not None and state.num_cached > cap and state.free.head is not None:
            self._evict_to_uncached(state.free.head)

    def _unlink_free(self, block: KVBlock) -> None:
        if block.block_hash is None:
            self.uncached.remove(block)
        else:
            self.tenants.unlink_free(block)

    def _evict_to_uncached(self, block: KVBlock) -> None:
        """Drop a free cached block's hash; it stays free, first in line for reuse."""
        self.tenants.unlink_free(block)
        self._evict(block)
        self.uncached.appendleft(block)

    def _evict(self, block: KVBlock) -> None:
        """The one place a cached block loses its hash (REMOVED event, owner's count)."""
        if block.block_hash is None:
            return
        if self.on_evict is not None:
            self.on_evict(block)
        del self.cached[block.block_hash]
        state = self.tenants.get(block.owner)
        self.events.emit(KVEventKind.REMOVED, [block.block_hash], state.share.tenant)
        state.num_cached -= 1
        state.num_evicted += 1
        block.block_hash = None
        block.token_ids = ()
        block.owner = None
