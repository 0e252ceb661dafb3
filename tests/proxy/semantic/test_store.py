"""TTL, capacity and LRU on both stores (Redis: the real server via the fixtures)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import numpy as np
import pytest

from proxy.semantic.keys import PartitionKey
from proxy.semantic.redis_store import RedisStore
from proxy.semantic.store import CacheEntry, EntryId, EntryStore, InMemoryStore, StoreConfig

pytestmark = pytest.mark.anyio


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def entry(i: int, clock: Clock, tenant: str = "t1", ttl: float = 100.0) -> CacheEntry:
    return CacheEntry(
        entry_id=EntryId(f"e{i}"), tenant_id=tenant, partition=PartitionKey("p"),
        prompt=f"prompt {i}", answer={"choices": [{"text": str(i)}]},
        vector=np.full(4, i, dtype=np.float32), created_at=clock.now,
        expires_at=clock.now + ttl, last_hit_at=clock.now,
    )  # fmt: skip


@pytest.fixture(params=["memory", "redis"])
async def make_store(
    request: pytest.FixtureRequest,
) -> AsyncIterator[Callable[[StoreConfig, Clock], EntryStore]]:
    made: list[EntryStore] = []

    def make(config: StoreConfig, clock: Clock) -> EntryStore:
        if request.param == "memory":
            store: EntryStore = InMemoryStore(config, clock)
        else:
            url = request.getfixturevalue("redis_url")
            prefix = request.getfixturevalue("redis_prefix")
            store = RedisStore(url, config, prefix=prefix, clock=clock)
        made.append(store)
        return store

    yield make
    for store in made:
        await store.aclose()


async def test_ttl_expiry(make_store: Callable[[StoreConfig, Clock], EntryStore]) -> None:
    clock = Clock()
    store = make_store(StoreConfig(ttl_s=100), clock)
    await store.put(entry(1, clock, ttl=100))
    await store.put(entry(2, clock, ttl=300))
    clock.now += 150
    assert await store.get("t1", EntryId("e1")) is None
    assert await store.record_hit("t1", EntryId("e1")) is None
    assert (await store.get("t1", EntryId("e2"))) is not None
    clock.now += 200
    removed = await store.expire()
    assert ("t1", EntryId("e2")) in removed
    assert (await store.snapshot())[1] == []


async def test_capacity_evicts_least_recently_used(
    make_store: Callable[[StoreConfig, Clock], EntryStore],
) -> None:
    clock = Clock()
    store = make_store(StoreConfig(capacity_per_tenant=3), clock)
    for i in range(3):
        clock.now += 1
        assert await store.put(entry(i, clock)) == []
    clock.now += 1
    hit = await store.record_hit("t1", EntryId("e0"))  # e0 becomes most recent
    assert hit is not None and hit.hit_count == 1 and hit.last_hit_at == clock.now
    clock.now += 1
    assert await store.put(entry(3, clock)) == [EntryId("e1")]
    clock.now += 1
    assert await store.put(entry(4, clock)) == [EntryId("e2")]
    ids = {e.entry_id for e in (await store.snapshot())[1]}
    assert ids == {"e0", "e3", "e4"}


async def test_tenants_are_separate(make_store: Callable[[StoreConfig, Clock], EntryStore]) -> None:
    clock = Clock()
    store = make_store(StoreConfig(capacity_per_tenant=1), clock)
    await store.put(entry(1, clock, tenant="a"))
    assert await store.put(entry(2, clock, tenant="b")) == []  # b's capacity is its own
    assert await store.get("b", EntryId("e1")) is None
    assert await store.delete("b", EntryId("e1")) is False
    assert await store.get("a", EntryId("e1")) is not None
    assert await store.flush("b") == 1
    assert await store.get("a", EntryId("e1")) is not None


async def test_entry_round_trip_and_request_memory(
    make_store: Callable[[StoreConfig, Clock], EntryStore],
) -> None:
    clock = Clock()
    store = make_store(StoreConfig(), clock)
    original = entry(7, clock)
    await store.put(original)
    got = await store.get("t1", EntryId("e7"))
    assert got == original
    assert got is not None and np.array_equal(got.vector, original.vector)
    await store.remember_request("t1", "req-1", EntryId("e7"))
    assert await store.entry_for_request("t1", "req-1") == "e7"
    assert await store.entry_for_request("t2", "req-1") is None
