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
* Parameters: ``num_blocks`` (pool size), ``block_size`` (tokens per block).
"""

from __future__ import annotations

from collections.abc import Callable

from engine.api import KVEventKind
from engine.kv.events import KVEventLog
from engine.kv.free_queue import BlockId, FreeBlockQueue, KVBlock
from engine.kv.hashing import BlockHash


class BlockPool:
    """Owns all blocks; hands them out and takes them back by ref count."""

    def __init__(self, num_blocks: int, block_size: int, events: KVEventLog | None = None) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks={num_blocks}, block_size={block_size} must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [KVBlock(BlockId(i)) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        self.events = events if events is not None else KVEventLog()
        # tier 2 (engine.kv.tier): told of each cached block before its hash is dropped
        self.on_evict: Callable[[KVBlock], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0 (cached or not): all can be handed out."""
        return len(self.free_queue)

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        """The cached block with this hash, or None."""
        return self.cached.get(block_hash)

    def allocate(self, num: int) -> list[KVBlock]:
        """Take ``num`` blocks from the free queue head, evicting their cached hashes."""
        if num > len(self.free_queue):
            raise RuntimeError(f"asked for {num} blocks, only {len(self.free_queue)} free")
        out: list[KVBlock] = []
        for _ in range(num):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Add one reference to each (prefix hit); free ones leave the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference to each; pass them in eviction order (first = evicted first)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed with ref_cnt {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def cache_block(
        self, block: KVBlock, block_hash: BlockHash, token_ids: tuple[int, ...]
    ) -> bool:
        """Register a full block under ``block_hash``; False if that hash is already cached."""
        if block.block_hash is not None:
            raise RuntimeError(f"block {block.block_id} is already cached")
        if len(token_ids) != self.block_size:
            raise RuntimeError(f"only full blocks are cached, got {len(token_ids)} tokens")
        if block_hash in self.cached:
            return False
        block.block_hash = block_hash
        block.token_ids = token_ids
        self.cached[block_hash] = block
        return True

    def evict_all_free(self) -> int:
        """Drop the hash of every free cached block (reset the prefix cache); count them."""
        n = 0
        for block in list(self.free_queue):
            if block.block_hash is not None:
                self._evict(block)
                n += 1
        return n

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self.on_evict is not None:
            self.on_evict(block)
        del self.cached[block.block_hash]
        self.events.emit(KVEventKind.REMOVED, [block.block_hash])
        block.block_hash = None
        block.token_ids = ()
