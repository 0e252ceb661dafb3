"""Tenant shares of the block pool: reservations, caps, running sequences first."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from engine.api import KVShare
from engine.kv.block_pool import BlockPool
from engine.kv.hashing import BlockHash, TenantSalt
from engine.kv.kv_manager import KVCacheManager

BS = 4
A, B = TenantSalt(b"tenant-a"), TenantSalt(b"tenant-b")


@dataclass
class Seq:
    seq_id: int
    token_ids: list[int]
    salt: TenantSalt | None = None
    num_computed_tokens: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)


def _prefill(kv: KVCacheManager, seq: Seq, use_reserved: bool = False) -> int | None:
    """Admit, compute and cache ``seq`` (None if it does not fit); its cached tokens."""
    prefix = kv.find_prefix(seq)
    if not kv.allocate_slots(seq, len(seq.token_ids) - len(prefix) * BS, prefix, use_reserved):
        return None
    seq.num_computed_tokens = len(seq.token_ids)
    kv.cache_full_blocks(seq)
    return len(prefix) * BS


def _flood(kv: KVCacheManager, salt: TenantSalt, start_id: int, rounds: int) -> None:
    for i in range(rounds):
        seq = Seq(start_id + i, list(range(1000 * (i + 1), 1000 * (i + 1) + 9)), salt)
        assert _prefill(kv, seq) is not None
        kv.free(seq)


def _a_working_set(kv: KVCacheManager) -> Seq:
    a = Seq(0, list(range(13)), A)  # 3 full blocks + 1 token
    assert _prefill(kv, a) == 0
    kv.free(a)
    return a


def test_without_reservation_a_flood_evicts_the_other_tenant() -> None:
    kv = KVCacheManager(BlockPool(8, BS))
    _a_working_set(kv)
    _flood(kv, B, 100, 6)
    assert _prefill(kv, Seq(1, list(range(13)), A)) == 0
    assert kv.pool.tenants.get(A).num_evicted == 3


def test_reserved_blocks_survive_another_tenants_flood() -> None:
    kv = KVCacheManager(BlockPool(8, BS))
    kv.pool.set_share(A, KVShare("a", reserved_blocks=3))
    _a_working_set(kv)
    _flood(kv, B, 100, 6)
    assert kv.pool.tenants.get(A).num_evicted == 0
    assert kv.pool.tenants.get(B).num_evicted > 0  # B recycles its own blocks
    assert _prefill(kv, Seq(1, list(range(13)), A)) == 12


def test_blocks_above_the_reservation_are_shared_lru() -> None:
    kv = KVCacheManager(BlockPool(8, BS))
    kv.pool.set_share(A, KVShare("a", reserved_blocks=1))
    _a_working_set(kv)
    _flood(kv, B, 100, 6)
    a = kv.pool.tenants.get(A)
    assert (a.num_cached, a.num_evicted) == (1, 2)  # the most recently freed block stays


def test_the_owner_may_evict_its_own_reserved_blocks() -> None:
    kv = KVCacheManager(BlockPool(4, BS))
    kv.pool.set_share(A, KVShare("a", reserved_blocks=4))
    _a_working_set(kv)
    assert _prefill(kv, Seq(1, list(range(500, 513)), A)) == 0


def test_admission_waits_but_a_running_sequence_takes_reserved_blocks() -> None:
    kv = KVCacheManager(BlockPool(5, BS))
    kv.pool.set_share(A, KVShare("a", reserved_blocks=3))
    _a_working_set(kv)  # 3 reserved cached blocks, 2 never-cached free ones
    b = Seq(1, list(range(100, 109)), B)  # needs 3 blocks
    assert not kv.can_allocate(b, 9, use_reserved=False)
    assert _prefill(kv, b, use_reserved=False) is None
    assert kv.pool.tenants.get(A).num_cached == 3  # nothing changed
    assert _prefill(kv, b, use_reserved=True) == 0  # running first: the cache gives way
    assert kv.pool.tenants.get(A).num_cached == 2


def test_cap_bounds_a_tenants_cached_blocks() -> None:
    kv = KVCacheManager(BlockPool(16, BS))
    kv.pool.set_share(B, KVShare("b", reserved_blocks=0, max_blocks=2))
    _flood(kv, B, 100, 4)  # 2 full blocks each
    b = kv.pool.tenants.get(B)
    assert b.num_cached == 2
    assert b.num_evicted == 6
    kv.pool.set_share(B, KVShare("b", reserved_blocks=0, max_blocks=1))
    assert b.num_cached == 1  # a lowered cap applies at once


def test_hits_and_lookups_are_counted_per_tenant() -> None:
    kv = KVCacheManager(BlockPool(8, BS))
    _a_working_set(kv)
    _prefill(kv, Seq(1, list(range(13)), A))
    a = kv.pool.tenants.get(A)
    assert (a.num_query_blocks, a.num_hit_blocks) == (6, 3)


@pytest.mark.parametrize(
    ("share", "message"),
    [
        (KVShare("a", reserved_blocks=9), "exceeds this worker's pool of 8 blocks"),
        (KVShare("a", reserved_blocks=-1), "non-negative"),
        (KVShare("a", reserved_blocks=4, max_blocks=3), ">= reserved_blocks"),
    ],
)
def test_impossible_shares_are_refused(share: KVShare, message: str) -> None:
    pool = BlockPool(8, BS)
    with pytest.raises(ValueError, match=message):
        pool.set_share(A, share)
    assert not pool.tenants.any_reserved
