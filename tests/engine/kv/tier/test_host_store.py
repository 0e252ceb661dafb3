"""Host tier quotas: per-tenant caps, total capacity, eviction confined to the tenant
that overflows (property test), spilling to disk."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kv.hashing import BlockHash, TenantSalt
from engine.kv.tier.host_store import HostTier

TENANTS = [TenantSalt(b"a" * 16), TenantSalt(b"b" * 16), None]


def _h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "big"))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 40), st.integers(1, 30)), max_size=80))
def test_caps_hold_and_only_the_putting_tenant_loses_blocks(
    puts: list[tuple[int, int, int]],
) -> None:
    tier = HostTier(capacity_bytes=100, tenant_cap_bytes=60)
    for t, i, size in puts:
        tenant = TENANTS[t]
        others = {
            (u, h) for u in TENANTS if u != tenant for h in map(_h, range(41))
            if tier.contains(u, h)
        }  # fmt: skip
        tier.put(tenant, _h(i), bytes(size))
        assert all(tier.contains(u, h) for u, h in others)  # nobody else evicted
        assert tier.num_bytes <= 100
        assert all(tier.tenant_bytes(u) <= 60 for u in TENANTS)


def test_lru_within_a_tenant_and_refusal_when_others_fill_the_tier() -> None:
    a, b = TENANTS[0], TENANTS[1]
    tier = HostTier(capacity_bytes=30, tenant_cap_bytes=20)
    assert tier.put(a, _h(1), bytes(10)) and tier.put(a, _h(2), bytes(10))
    assert tier.get(a, _h(1)) is not None  # 1 is now the most recent
    assert tier.put(a, _h(3), bytes(10))  # over a's cap: evicts a's LRU, block 2
    assert not tier.contains(a, _h(2)) and tier.contains(a, _h(1))
    assert tier.put(b, _h(4), bytes(10))
    assert not tier.put(b, _h(5), bytes(20))  # b cannot evict a to make room
    assert tier.contains(a, _h(1)) and tier.contains(a, _h(3))
    assert tier.get(b, _h(1)) is None  # same hash, other tenant: a miss


def test_memory_evictions_spill_to_disk_and_read_back(tmp_path: Path) -> None:
    a = TENANTS[0]
    tier = HostTier(capacity_bytes=20, spill_dir=tmp_path, spill_bytes=100)
    for i in range(5):
        assert tier.put(a, _h(i), bytes([i]) * 10)
    assert tier.num_bytes == 20 and tier.num_disk_bytes == 30
    assert tier.get(a, _h(0)) == bytes([0]) * 10  # from disk
    tier.discard(a, _h(0))
    assert tier.get(a, _h(0)) is None and tier.num_disk_bytes == 20


def test_a_block_remembers_it_came_from_the_shared_store(tmp_path: Path) -> None:
    a = TENANTS[0]
    tier = HostTier(20, spill_dir=tmp_path, spill_bytes=20)
    assert tier.put(a, _h(1), b"x" * 10, shared=True) and tier.put(a, _h(2), b"y" * 10)
    assert tier.from_shared(a, _h(1)) and not tier.from_shared(a, _h(2))
    assert not tier.from_shared(TENANTS[1], _h(1))  # per tenant
    tier.put(a, _h(3), b"z" * 10)  # _h(1) spills to disk, still from the shared store
    assert tier.get(a, _h(1)) == b"x" * 10 and tier.from_shared(a, _h(1))
    tier.discard(a, _h(1))
    assert not tier.from_shared(a, _h(1))
    tier.put(a, _h(4), b"w" * 10, shared=True)
    for i in range(5, 9):  # pushes _h(4) out of memory and disk
        tier.put(a, _h(i), b"v" * 10)
    assert not tier.contains(a, _h(4)) and not tier.from_shared(a, _h(4))
