"""Semantic capacity per tenant (entries and bytes) on both stores; eviction stays inside
the tenant that overflows. Redis: the real server via the fixtures."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.semantic.capacity import CapacityTable, TenantCapacity, entry_size
from proxy.semantic.keys import PartitionKey
from proxy.semantic.redis_store import RedisStore
from proxy.semantic.store import CacheEntry, EntryId, EntryStore, InMemoryStore, StoreConfig

pytestmark = pytest.mark.anyio
NOW = 1000.0


def _entry(i: int, tenant: str = "a", text_len: int = 10) -> CacheEntry:
    return CacheEntry(
        entry_id=EntryId(f"e{i}"), tenant_id=tenant, partition=PartitionKey("p"),
        prompt="x" * text_len, answer={"t": i}, vector=np.zeros(4, dtype=np.float32),
        created_at=NOW + i, expires_at=NOW + 10_000, last_hit_at=NOW + i,
    )  # fmt: skip


@pytest.fixture(params=["memory", "redis"])
async def make_store(
    request: pytest.FixtureRequest,
) -> AsyncIterator[Callable[[StoreConfig], EntryStore]]:
    made: list[EntryStore] = []

    def make(config: StoreConfig) -> EntryStore:
        if request.param == "memory":
            store: EntryStore = InMemoryStore(config, lambda: NOW)
        else:
            url = request.getfixturevalue("redis_url")
            prefix = request.getfixturevalue("redis_prefix")
            store = RedisStore(url, config, prefix=prefix, clock=lambda: NOW)
        made.append(store)
        return store

    yield make
    for store in made:
        await store.aclose()


async def test_a_tenants_byte_limit_evicts_only_its_own_lru_entries(
    make_store: Callable[[StoreConfig], EntryStore],
) -> None:
    size = entry_size(_entry(0))
    store = make_store(StoreConfig(capacity_per_tenant=100))
    store.capacity.set("a", TenantCapacity(max_bytes=3 * size))
    for i in range(3):
        assert await store.put(_entry(i)) == []
        assert await store.put(_entry(100 + i, tenant="b")) == []
    assert await store.put(_entry(3)) == [EntryId("e0")]  # a overflows: a's oldest goes
    for i in range(3):
        assert await store.get("b", EntryId(f"e{100 + i}")) is not None  # b untouched
    assert await store.delete("a", EntryId("e1"))
    assert await store.put(_entry(4)) == []  # the deleted entry's bytes were given back
    huge = _entry(9, text_len=10 * size)
    assert EntryId("e9") in await store.put(huge)  # larger than the whole limit: not kept
    assert await store.get("a", EntryId("e9")) is None


async def test_a_tenants_entry_limit_overrides_the_default(
    make_store: Callable[[StoreConfig], EntryStore],
) -> None:
    store = make_store(StoreConfig(capacity_per_tenant=2))
    store.capacity.set("a", TenantCapacity(max_entries=3))
    for i in range(3):
        assert await store.put(_entry(i)) == []
    assert await store.put(_entry(3)) == [EntryId("e0")]
    assert await store.put(_entry(10, tenant="b")) == []
    assert await store.put(_entry(11, tenant="b")) == []
    assert await store.put(_entry(12, tenant="b")) == [EntryId("e10")]
    store.capacity.set("a", TenantCapacity())  # back to the default of 2
    assert await store.put(_entry(4)) == [EntryId("e1"), EntryId("e2")]
    assert await store.flush("a") == 2
    store.capacity.set("a", TenantCapacity(max_bytes=2 * entry_size(_entry(0))))
    assert await store.put(_entry(5)) == []  # flush reset a's bytes


def test_capacity_defaults_and_bad_values() -> None:
    table = CapacityTable(10, None)
    assert table.limits("x") == (10, None)
    table.set("x", TenantCapacity(max_bytes=5))
    assert table.limits("x") == (10, 5) and table.over("x", 1, 6) and not table.over("x", 10, 5)
    with pytest.raises(ValueError):
        CapacityTable(0)
    with pytest.raises(ValueError):
        StoreConfig(bytes_per_tenant=0)


OPS = st.lists(
    st.tuples(st.sampled_from(["put", "delete", "hit"]), st.sampled_from("abc"),
              st.integers(0, 15), st.integers(0, 40)),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=OPS, max_bytes=st.integers(60, 300), max_entries=st.integers(1, 6))
def test_in_memory_store_keeps_each_tenant_within_its_limits(
    ops: list[tuple[str, str, int, int]], max_bytes: int, max_entries: int
) -> None:
    import asyncio

    async def run() -> None:
        store = InMemoryStore(StoreConfig(capacity_per_tenant=max_entries), lambda: NOW)
        store.capacity.set("a", TenantCapacity(max_bytes=max_bytes))
        live: dict[str, dict[str, CacheEntry]] = {t: {} for t in "abc"}
        for op, tenant, i, text_len in ops:
            eid = EntryId(f"{tenant}{i}")
            if op == "put":
                e = _entry(i, tenant, text_len)
                e = CacheEntry(**{**e.__dict__, "entry_id": eid})
                others = {t: dict(v) for t, v in live.items() if t != tenant}
                evicted = await store.put(e)
                live[tenant][eid] = e
                for gone in evicted:
                    live[tenant].pop(gone, None)
                assert {t: v for t, v in live.items() if t != tenant} == others
            elif op == "delete":
                assert await store.delete(tenant, eid) == (live[tenant].pop(eid, None) is not None)
            else:
                assert (await store.record_hit(tenant, eid) is None) == (eid not in live[tenant])
            for t, entries in live.items():
                assert store._bytes.get(t) == sum(entry_size(x) for x in entries.values())
                assert not store.capacity.over(t, len(entries), store._bytes.get(t))

    asyncio.run(run())
