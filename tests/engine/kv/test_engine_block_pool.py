"""Exact block ids, prefix hits and eviction order of the pool and KV manager."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.api import KVEventKind
from engine.kv.block_pool import BlockPool
from engine.kv.hashing import BlockHash, TenantSalt, hash_prompt_blocks
from engine.kv.kv_manager import KVCacheManager

BS = 4


@dataclass
class Seq:
    seq_id: int
    token_ids: list[int]
    salt: TenantSalt | None = None
    num_computed_tokens: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)


def _run_prefill(kv: KVCacheManager, seq: Seq) -> int:
    """Admit with prefix lookup, compute everything, cache; returns cached tokens."""
    prefix = kv.find_prefix(seq)
    assert kv.allocate_slots(seq, len(seq.token_ids) - len(prefix) * BS, prefix)
    seq.num_computed_tokens = len(seq.token_ids)
    kv.cache_full_blocks(seq)
    return len(prefix) * BS


def test_allocation_takes_lowest_ids_first_and_hashes_match_router() -> None:
    kv = KVCacheManager(BlockPool(8, BS))
    a = Seq(0, list(range(10)))  # 2 full blocks + 2 tokens
    assert _run_prefill(kv, a) == 0
    assert kv.block_ids(0) == (0, 1, 2)
    assert a.block_hashes == hash_prompt_blocks(a.token_ids, BS)
    events = kv.pool.events.since(0)
    assert [(e.seq, e.kind) for e in events] == [(0, KVEventKind.STORED)]
    assert events[0].block_hashes == tuple(hash_prompt_blocks(a.token_ids, BS))


def test_prefix_hit_shares_blocks_and_leaves_last_token_to_compute() -> None:
    kv = KVCacheManager(BlockPool(8, BS))
    _run_prefill(kv, Seq(0, list(range(10))))
    b = Seq(1, [*range(8), 99, 98, 97])
    assert _run_prefill(kv, b) == 8
    assert kv.block_ids(1) == (0, 1, 3)
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    exact = Seq(2, list(range(8)))  # fully cached: the last block is recomputed
    assert _run_prefill(kv, exact) == 4
    assert kv.block_ids(2) == (0, 4)


def test_salt_isolates_tenants() -> None:
    kv = KVCacheManager(BlockPool(8, BS))
    _run_prefill(kv, Seq(0, list(range(9)), salt=TenantSalt(b"tenant-a")))
    other = Seq(1, list(range(9)), salt=TenantSalt(b"tenant-b"))
    assert _run_prefill(kv, other) == 0
    assert set(kv.block_ids(0)).isdisjoint(kv.block_ids(1))
    same = Seq(2, list(range(9)), salt=TenantSalt(b"tenant-a"))
    assert _run_prefill(kv, same) == 8


def test_eviction_order_uncached_first_then_lru_tail_first() -> None:
    kv = KVCacheManager(BlockPool(6, BS))
    a, b = Seq(0, list(range(9))), Seq(1, list(range(100, 109)))
    _run_prefill(kv, a)  # blocks 0,1 cached, 2 partial
    _run_prefill(kv, b)  # blocks 3,4 cached, 5 partial
    kv.free(a)
    kv.free(b)
    # uncached partial blocks go to the head; cached ones to the tail, each seq's tail first
    assert [blk.block_id for blk in kv.pool.free_blocks()] == [5, 2, 1, 0, 4, 3]
    c = Seq(2, list(range(200, 212)))  # 3 blocks: reuses 5, 2, then evicts 1 (a's tail)
    assert _run_prefill(kv, c) == 0
    assert kv.block_ids(2) == (5, 2, 1)
    removed = [e for e in kv.pool.events.since(0) if e.kind is KVEventKind.REMOVED]
    assert [e.block_hashes for e in removed] == [(a.block_hashes[1],)]
    a2 = Seq(3, list(range(9)))
    assert _run_prefill(kv, a2) == 4  # block 0 survived, block 1 was evicted


def test_hit_on_free_cached_block_revives_it() -> None:
    kv = KVCacheManager(BlockPool(4, BS))
    a = Seq(0, list(range(8)))
    _run_prefill(kv, a)
    kv.free(a)
    assert kv.pool.num_free_blocks == 4
    b = Seq(1, [*range(4), 50, 51])
    prefix = kv.find_prefix(b)
    assert [blk.block_id for blk in prefix] == [0]
    assert not kv.can_allocate(b, 2 + 3 * BS, prefix)  # 4 more blocks + the revived one > 4
    assert kv.allocate_slots(b, 2, prefix)
    assert b.num_computed_tokens == 0  # the caller, not the manager, counts the prefix
    assert kv.block_ids(1) == (0, 2)  # the prefix block, then a never-cached one
    assert kv.pool.blocks[0].ref_cnt == 1
    assert kv.pool.num_free_blocks == 2


def test_token_recheck_rejects_a_hash_hit_with_other_tokens() -> None:
    kv = KVCacheManager(BlockPool(4, BS))
    a = Seq(0, list(range(5)))
    _run_prefill(kv, a)
    block = kv.pool.blocks[0]
    block.token_ids = (7, 7, 7, 7)  # simulate a colliding hash holding other tokens
    assert kv.find_prefix(Seq(1, list(range(6)))) == []
