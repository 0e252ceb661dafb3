"""Per-sequence block tables on top of the :class:`BlockPool`, with prefix lookup.

::

    seq tokens : [ 16 | 16 | 16 | 7 ]   block_size = 16, 55 tokens
    table      : [ b4 , b9 , b2 , b5 ]  b4, b9 may be shared (prefix hit, ref_cnt > 1)
    hashes     : [ h0 , h1 , h2 ]       full blocks only; h0 carries the tenant salt

Check-then-act: :meth:`KVCacheManager.allocate_slots` returns False (and changes
nothing) when the pool cannot supply the blocks; the scheduler then preempts.
A prefix hit re-checks the cached block's token ids and never covers the last
token of a sequence (its logits must be computed). Blocks are allocated for the
sequence's tenant (its salt): ``use_reserved=False`` keeps other tenants' reserved
cached blocks out of reach (:mod:`engine.kv.tenant_shares`). The manager reads a sequence's
progress (``num_computed_tokens``) and never writes it: the scheduler does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from engine.api import KVEventKind
from engine.kv.block_pool import BlockPool
from engine.kv.free_queue import BlockId, KVBlock
from engine.kv.hashing import ROOT_HASH, BlockHash, TenantSalt, hash_block


class CacheableSeq(Protocol):
    """What the KV manager needs to know about a sequence."""

    seq_id: int
    salt: TenantSalt | None
    token_ids: list[int]
    block_hashes: list[BlockHash]

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose K/V are in the sequence's blocks (read here, never written)."""
        ...


@dataclass(frozen=True)
class Promoted:
    """Blocks a tier loaded into the pool (cached, free, in prefix order) and how many
    of them the shared store had supplied (the others came from the host tier)."""

    blocks: list[KVBlock]
    num_shared: int = 0


@dataclass(frozen=True)
class TierLoaded:
    """Blocks of one sequence's prefix loaded from tier 2, by the tier that held them."""

    host_blocks: int = 0
    shared_blocks: int = 0


class PrefixTier(Protocol):
    """Tier 2 as the manager sees it (:class:`engine.kv.tier.tier.KVTier`)."""

    def promote(
        self, pool: BlockPool, seq: CacheableSeq, resident: Sequence[KVBlock]
    ) -> Promoted:
        """Blocks loaded from the tier that extend ``resident`` (cached, free)."""
        ...

    def note_cached(self, blocks: Sequence[KVBlock], salt: TenantSalt | None) -> None:
        """``blocks`` were just registered in the prefix cache."""
        ...


class KVCacheManager:
    """Block tables per sequence; allocation, prefix hits, caching and freeing."""

    def __init__(self, pool: BlockPool, tier: PrefixTier | None = None) -> None:
        self.pool = pool
        self.tier = tier  # tier 2: extends prefix hits, hears of newly cached blocks
        self.block_size = pool.block_size
        self._tables: dict[int, list[KVBlock]] = {}
        self._ids: dict[int, tuple[BlockId, ...]] = {}  # _tables as ids, built on change
        self._num_hashed: dict[int, int] = {}
        self._tier_loaded: dict[int, TierLoaded] = {}  # seq id -> loaded before admission

    def block_ids(self, seq_id: int) -> tuple[BlockId, ...]:
        """The sequence's block table as ids (empty if it holds none); kept from one
        change of the table to the next, so a decode step does not rebuild it."""
        return self._ids.get(seq_id, ())

    def blocks(self, seq_id: int) -> list[KVBlock]:
        """The sequence's blocks (a copy of its table)."""
        return list(self._tables.get(seq_id, []))

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def update_hashes(self, seq: CacheableSeq) -> None:
        """Extend ``seq.block_hashes`` to cover every full block of its tokens."""
        bs = self.block_size
        hashes = seq.block_hashes
        while len(hashes) < len(seq.token_ids) // bs:
            i = len(hashes)
            parent = hashes[-1] if hashes else ROOT_HASH
            extra = seq.salt if i == 0 else None
            hashes.append(hash_block(parent, seq.token_ids[i * bs : (i + 1) * bs], extra))

    def find_prefix(self, seq: CacheableSeq) -> list[KVBlock]:
        """Longest run of cached blocks matching the sequence's leading full blocks."""
        self.update_hashes(seq)
        bs = self.block_size
        max_blocks = (len(seq.token_ids) - 1) // bs
        hits: list[KVBlock] = []
        for i, h in enumerate(seq.block_hashes[:max_blocks]):
            block = self.pool.lookup(h)
            if block is None or block.token_ids != tuple(seq.token_ids[i * bs : (i + 1) * bs]):
                break
            hits.append(block)
        if self.tier is not None:
            promoted = self.tier.promote(self.pool, seq, hits)
            if promoted.blocks:
                seen = self._tier_loaded.get(seq.seq_id, TierLoaded())
                self._tier_loaded[seq.seq_id] = TierLoaded(
                    seen.host_blocks + len(promoted.blocks) - promoted.num_shared,
                    seen.shared_blocks + promoted.num_shared,
                )
            hits += promoted.blocks
        return hits

    def take_tier_loaded(self, seq: CacheableSeq) -> TierLoaded | None:
        """What :meth:`find_prefix` loaded from tier 2 for ``seq`` since the last call
        (forgotten here); None without a tier."""
        if self.tier is None:
            return None
        return self._tier_loaded.pop(seq.seq_id, TierLoaded())

    def can_allocate(
        self,
        seq: CacheableSeq,
        num_new_tokens: int,
        prefix: Sequence[KVBlock] = (),
        use_reserved: bool = True,
    ) -> bool:
        """Whether :meth:`allocate_slots` would succeed."""
        return self._blocks_short(seq, num_new_tokens, prefix, use_reserved) <= 0

    def allocate_slots(
        self,
        seq: CacheableSeq,
        num_new_tokens: int,
        prefix: Sequence[KVBlock] = (),
        use_reserved: bool = True,
    ) -> bool:
        """Make room for ``num_new_tokens`` more tokens, first adopting ``prefix`` blocks.

        ``prefix`` is only allowed for a sequence that holds no blocks yet; the new
        tokens then follow the prefix (the caller counts the prefix's tokens as computed;
        ``num_computed_tokens`` is not changed here). False = nothing changed.
        """
        table = self._tables.get(seq.seq_id, [])
        if prefix and (table or seq.num_computed_tokens):
            raise RuntimeError(
                f"seq {seq.seq_id}: prefix given to a sequence that already has blocks"
            )
        if self._blocks_short(seq, num_new_tokens, prefix, use_reserved) > 0:
            return False
        if seq.seq_id not in self._tables:
            self._count_lookup(seq, len(prefix))
        if prefix:
            self.pool.touch(list(prefix))
            table = table + list(prefix)
        total = seq.num_computed_tokens + len(prefix) * self.block_size + num_new_tokens
        need = self.num_blocks_for(total) - len(table)
        if need > 0:
            table = table + self.pool.allocate(need, seq.salt, use_reserved)
        if need > 0 or prefix or seq.seq_id not in self._tables:
            self._tables[seq.seq_id] = table
            self._ids[seq.seq_id] = tuple(b.block_id for b in table)
        self._num_hashed.setdefault(seq.seq_id, len(prefix))
        return True

    def cache_full_blocks(self, seq: CacheableSeq) -> None:
        """Register every block now full of computed tokens in the prefix cache."""
        table = self._tables.get(seq.seq_id, [])
        num_full = min(seq.num_computed_tokens // self.block_size, len(table))
        start = self._num_hashed.get(seq.seq_id, 0)
        if num_full <= start:
            return
        self.update_hashes(seq)
        bs = self.block_size
        stored: list[BlockHash] = []
        stored_blocks: list[KVBlock] = []
        for i in range(start, num_full):
            block = table[i]
            if block.block_hash is not None:
                continue
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            if self.pool.cache_block(block, seq.block_hashes[i], tokens, seq.salt):
                stored.append(seq.block_hashes[i])
                stored_blocks.append(block)
        self._num_hashed[seq.seq_id] = num_full
        tenant = self.pool.tenants.get(seq.salt).share.tenant
        self.pool.events.emit(KVEventKind.STORED, stored, tenant)
        if self.tier is not None and stored_blocks:
            self.tier.note_cached(stored_blocks, seq.salt)

    def free(self, seq: CacheableSeq) -> None:
        """Release the sequence's blocks (tail first, so its tail is evicted first)."""
        table = self._tables.pop(seq.seq_id, [])
        self._ids.pop(seq.seq_id, None)
        self._num_hashed.pop(seq.seq_id, None)
        self._tier_loaded.pop(seq.seq_id, None)
        self.pool.free(list(reversed(table)))

    def _count_lookup(self, seq: CacheableSeq, num_hit_blocks: int) -> None:
        """Per-tenant hit counters, once per admission (metrics)."""
        state = self.pool.tenants.get(seq.salt)
        state.num_query_blocks += max(0, (len(seq.token_ids) - 1) // self.block_size)
        state.num_hit_blocks += num_hit_blocks

    def _blocks_short(
        self,
        seq: CacheableSeq,
        num_new_tokens: int,
        prefix: Sequence[KVBlock],
        use_reserved: bool,
    ) -> int:
        table = self._tables.get(seq.seq_id, [])
        total = seq.num_computed_tokens + len(prefix) * self.block_size + num_new_tokens
        need = max(0, self.num_blocks_for(total) - len(table) - len(prefix))
        revived = sum(1 for b in prefix if b.ref_cnt == 0)
        return need + revived - self.pool.num_available(seq.salt, use_reserved)
