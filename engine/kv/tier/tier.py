"""The engine's view of tier 2: hooks called by the block pool, the KV manager and
the engine, and the prefetch called off the step loop.

Step thread (the engine's, never blocking on a store):

* :meth:`KVTier.note_cached`: blocks just registered in the prefix cache; remembers
  their tenant and, with a shared store, gathers them for a write-through (another
  worker can then load a prefix this one still holds).
* :meth:`KVTier.on_evict`: the pool drops a cached block's hash; it is queued for the
  host tier unless already there. :meth:`KVTier.flush` gathers the queued blocks in
  one copy; the engine calls it before every model step (and :meth:`promote` before
  it overwrites blocks), so no block is reused before it was copied.
* :meth:`KVTier.promote`: at admission, the run of blocks right after the resident
  prefix that the host tier holds (same tenant salt) is decoded, checked and written
  into free pool blocks, registered as cached (a STORED event) and left free; the
  prefix lookup then finds them like any cached block, so their tokens count as
  ``cached_tokens``. Only when the measured load cost beats recompute
  (:mod:`engine.kv.tier.cost`) and the pool can hold the whole sequence.

Other threads: :meth:`KVTier.prefetch` (before a request is queued) copies from the
shared store into the host tier the blocks of the prompt that neither the pool nor
the host tier holds, bounded by the store's timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from engine.api import KVEventKind
from engine.kv.block_pool import BlockPool
from engine.kv.free_queue import KVBlock
from engine.kv.hashing import BlockHash, hash_prompt_blocks
from engine.kv.kv_manager import CacheableSeq, Promoted
from engine.kv.tier.block_io import BlockIO
from engine.kv.tier.codec import BlockKey, CorruptBlock, decode, verify
from engine.kv.tier.config import TierConfig
from engine.kv.tier.cost import LoadCost
from engine.kv.tier.host_store import HostTier, Tenant
from engine.kv.tier.shared_redis import RedisBlockStore
from engine.kv.tier.write_behind import WriteBehind, WriteJob

DEFAULT_LOAD_FRACTION = 0.5  # the router's prior for a shared block before any measurement


class KVTier:
    """Host tier + optional shared store behind the engine's hooks."""

    def __init__(
        self,
        config: TierConfig,
        model: str,
        io: BlockIO,
        shared: RedisBlockStore | None = None,
    ) -> None:
        self.config = config
        self.model = model
        self.io = io
        self.block_size = io.shape[1]
        self.host = HostTier(
            config.host_bytes,
            max(1, int(config.host_bytes * config.tenant_fraction)),
            config.spill_dir,
            config.spill_bytes,
        )
        self.shared = shared
        self.cost = LoadCost()
        self.writer = WriteBehind(self.host, shared, config.mode, config.queue_blocks)
        self._tenants: dict[BlockHash, Tenant] = {}  # cached pool blocks -> tenant salt
        self._evicted: list[tuple[int, BlockKey]] = []
        self.num_loaded_blocks = 0
        self.load_seconds = 0.0
        self.num_prefetched_blocks = 0
        self.num_skipped_loads = 0  # tier hits recomputed because recompute was cheaper

    def key(self, salt: Tenant, block_hash: BlockHash) -> BlockKey:
        return BlockKey(self.model, salt, block_hash)

    # -- step thread -------------------------------------------------------------
    def note_cached(self, blocks: Sequence[KVBlock], salt: Tenant) -> None:
        """``blocks`` were just registered in the prefix cache for tenant ``salt``."""
        hashes = [b.block_hash for b in blocks if b.block_hash is not None]
        for h in hashes:
            self._tenants[h] = salt
        if self.shared is not None and hashes:
            keys = tuple(self.key(salt, h) for h in hashes)
            data = self.io.read([b.block_id for b in blocks if b.block_hash is not None])
            self.writer.submit(WriteJob(keys, data, to_host=False, to_shared=True))

    def on_evict(self, block: KVBlock) -> None:
        """The pool is dropping ``block``'s hash (its data is still intact)."""
        h = block.block_hash
        if h is None or h not in self._tenants:
            return
        tenant = self._tenants.pop(h)
        if not self.host.contains(tenant, h):
            self._evicted.append((block.block_id, self.key(tenant, h)))

    def flush(self) -> None:
        """Copy the blocks evicted since the last flush and hand them to the writer."""
        if not self._evicted:
            return
        ids = [block_id for block_id, _ in self._evicted]
        keys = tuple(key for _, key in self._evicted)
        self._evicted = []
        self.writer.submit(WriteJob(keys, self.io.read(ids), to_host=True, to_shared=False))

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A model step computed ``num_tokens`` tokens in ``seconds`` (the recompute
        side of the cost model; steps under one block of tokens are decode steps)."""
        if num_tokens >= self.block_size:
            self.cost.observe_prefill(num_tokens, seconds)

    def promote(
        self, pool: BlockPool, seq: CacheableSeq, resident: Sequence[KVBlock]
    ) -> Promoted:
        """Load the host tier's blocks that extend ``resident``; the pool blocks now
        holding them (cached, free), in prefix order, and how many of them a prefetch
        had brought from the shared store."""
        bs = self.block_size
        start, stop = len(resident), (len(seq.token_ids) - 1) // bs
        found: list[tuple[BlockHash, bytes]] = []
        for h in seq.block_hashes[start:stop]:
            data = None if pool.lookup(h) is not None else self.host.get(seq.salt, h)
            if data is None:
                break
            found.append((h, data))
        if not found:
            return Promoted([])
        spare = pool.num_free_blocks - sum(1 for b in resident if b.ref_cnt == 0)
        if spare < -(-len(seq.token_ids) // bs) - len(resident):
            return Promoted([])  # the sequence would not fit anyway: it waits, nothing loaded
        if not self.cost.worth_loading(bs):
            self.num_skipped_loads += len(found)
            return Promoted([])
        shared = [self.host.from_shared(seq.salt, h) for h, _ in found]
        blocks = self._load(pool, seq, resident, start, found)
        return Promoted(blocks, sum(shared[: len(blocks)]))

    def _load(
        self,
        pool: BlockPool,
        seq: CacheableSeq,
        resident: Sequence[KVBlock],
        start: int,
        found: list[tuple[BlockHash, bytes]],
    ) -> list[KVBlock]:
        t0 = time.perf_counter()
        tensors = []
        for h, data in found:
            try:
                tensors.append(decode(self.key(seq.salt, h), data, self.io.shape))
            except CorruptBlock:
                self.host.discard(seq.salt, h)
                break
        if not tensors:
            return []
        import torch

        pool.touch(list(resident))  # not evicted by the allocation below
        blocks = pool.allocate(len(tensors))
        self.flush()  # blocks the allocation evicted are copied before being overwritten
        self.io.write([b.block_id for b in blocks], torch.stack(tensors))
        bs = self.block_size
        stored: list[BlockHash] = []
        for i, (block, (h, _)) in enumerate(zip(blocks, found, strict=False)):
            pos = (start + i) * bs
            if pool.cache_block(block, h, tuple(seq.token_ids[pos : pos + bs])):
                self._tenants[h] = seq.salt
                stored.append(h)
        pool.events.emit(KVEventKind.STORED, stored)
        pool.free(list(reversed(blocks)))
        pool.free(list(resident))
        elapsed = time.perf_counter() - t0
        self.cost.observe_load(len(blocks), elapsed)
        self.num_loaded_blocks += len(blocks)
        self.load_seconds += elapsed
        return blocks

    # -- other threads -----------------------------------------------------------
    def prefetch(
        self, salt: Tenant, token_ids: Sequence[int], resident: Callable[[BlockHash], bool]
    ) -> int:
        """Copy the prompt's blocks that only the shared store holds into the host
        tier (checked first); the number copied. Bounded by the store's timeout."""
        if self.shared is None:
            return 0
        bs = self.block_size
        hashes = hash_prompt_blocks(token_ids[: max(0, len(token_ids) - 1)], bs, salt)
        wanted = [h for h in hashes if not resident(h) and not self.host.contains(salt, h)]
        if not wanted:
            return 0
        values = self.shared.get_many([self.key(salt, h) for h in wanted])
        copied = 0
        for h, data in zip(wanted, values, strict=True):
            if data is None:
                break
            try:
                verify(self.key(salt, h), data, self.io.shape)
            except CorruptBlock:
                self.host.stats.corrupt += 1
                break
            if not self.host.put(salt, h, data, shared=True):
                break
            copied += 1
        self.num_prefetched_blocks += copied
        return copied

    def shared_load_fraction(self) -> float | None:
        """What the router counts a block in the shared tier at, as a fraction of
        recomputing it: the measured load cost (``DEFAULT_LOAD_FRACTION`` until this
        worker has measured both sides), within [0, 1]; None without a shared store."""
        if self.shared is None:
            return None
        measured = self.cost.load_fraction(self.block_size)
        fraction = DEFAULT_LOAD_FRACTION if measured is None else measured
        return round(min(1.0, max(0.0, fraction)), 4)

    def close(self) -> None:
        self.writer.close()
        if self.shared is not None:
            self.shared.close()
