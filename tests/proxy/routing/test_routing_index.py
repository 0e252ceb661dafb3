"""Prefix indexes against brute-force models (hypothesis) and their edge cases."""

from __future__ import annotations

from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.api import KVEvent, KVEventKind
from engine.kv.hashing import BlockHash
from proxy.routing.index import ApproxIndex, PreciseIndex
from proxy.routing.types import WorkerId

WORKERS = [WorkerId("a"), WorkerId("b"), WorkerId("c")]


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "big"))


def leading(held: set[BlockHash] | dict[BlockHash, float], query: list[BlockHash]) -> int:
    count = 0
    for x in query:
        if x not in held:
            break
        count += 1
    return count


hash_lists = st.lists(st.integers(0, 12).map(h), min_size=0, max_size=6)
ops = st.lists(
    st.tuples(st.sampled_from(WORKERS), st.sampled_from(["stored", "removed"]), hash_lists),
    max_size=30,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, queries=st.lists(hash_lists, min_size=1, max_size=5))
def test_precise_index_matches_brute_force(
    ops: list[tuple[WorkerId, str, list[BlockHash]]], queries: list[list[BlockHash]]
) -> None:
    index = PreciseIndex()
    model: dict[WorkerId, set[BlockHash]] = {w: set() for w in WORKERS}
    seqs = dict.fromkeys(WORKERS, 0)
    for worker, kind, hashes in ops:
        event = KVEvent(seqs[worker], KVEventKind(kind), tuple(hashes))
        seqs[worker] += 1
        result = index.apply_events(worker, [event])
        assert (result.num_applied, result.reset) == (1, False)
        if kind == "stored":
            model[worker] |= set(hashes)
        else:
            model[worker] -= set(hashes)
    for query in queries:
        got = index.match(query, WORKERS)
        assert got == {w: leading(model[w], query) for w in WORKERS}
    for w in WORKERS:
        assert index.num_blocks(w) == len(model[w])


@settings(max_examples=150, deadline=None)
@given(
    records=st.lists(
        st.tuples(st.sampled_from(WORKERS), hash_lists, st.floats(0.0, 5.0)), max_size=25
    ),
    query=hash_lists,
    capacity=st.integers(1, 8),
)
def test_approx_index_matches_lru_ttl_model(
    records: list[tuple[WorkerId, list[BlockHash], float]],
    query: list[BlockHash],
    capacity: int,
) -> None:
    now = [0.0]
    ttl = 10.0
    index = ApproxIndex(max_blocks_per_worker=capacity, ttl_s=ttl, clock=lambda: now[0])
    model: dict[WorkerId, OrderedDict[BlockHash, float]] = {w: OrderedDict() for w in WORKERS}
    for worker, hashes, advance in records:
        now[0] += advance
        index.record(worker, hashes)
        lru = model[worker]
        for x in reversed(hashes):
            lru[x] = now[0] + ttl
            lru.move_to_end(x)
        while len(lru) > capacity:
            lru.popitem(last=False)
    now[0] += 3.0
    alive = {w: {x: e for x, e in model[w].items() if e > now[0]} for w in WORKERS}
    assert index.match(query, WORKERS) == {w: leading(alive[w], query) for w in WORKERS}


def test_precise_index_stops_at_first_missing_block() -> None:
    index = PreciseIndex()
    a = WORKERS[0]
    index.apply_events(a, [KVEvent(0, KVEventKind.STORED, (h(1), h(3)))])
    assert index.match([h(1), h(2), h(3)], [a]) == {a: 1}


def test_precise_index_skips_duplicates_and_resets_on_a_gap() -> None:
    index = PreciseIndex()
    a = WORKERS[0]
    index.apply_events(a, [KVEvent(0, KVEventKind.STORED, (h(1), h(2)))])
    again = index.apply_events(a, [KVEvent(0, KVEventKind.STORED, (h(1), h(2)))])
    assert (again.num_applied, again.num_skipped, again.reset) == (0, 1, False)
    gap = index.apply_events(a, [KVEvent(5, KVEventKind.STORED, (h(7),))])
    assert gap.reset and gap.next_seq == 6
    assert index.match([h(1)], [a]) == {a: 0}  # what happened in seq 1..4 is unknown
    assert index.match([h(7)], [a]) == {a: 1}


def test_remove_worker_forgets_blocks_and_cursor() -> None:
    index = PreciseIndex()
    a, b = WORKERS[0], WORKERS[1]
    index.apply_events(a, [KVEvent(0, KVEventKind.STORED, (h(1),))])
    index.apply_events(b, [KVEvent(0, KVEventKind.STORED, (h(1),))])
    index.remove_worker(a)
    assert index.match([h(1)], [a, b]) == {a: 0, b: 1}
    assert index.next_seq(a) == 0


def test_approx_index_evicts_children_before_their_root() -> None:
    index = ApproxIndex(max_blocks_per_worker=3, ttl_s=60.0, clock=lambda: 0.0)
    a = WORKERS[0]
    index.record(a, [h(1), h(2), h(3)])
    index.record(a, [h(1), h(9)])  # h(3) is the least recent leaf
    assert index.match([h(1), h(2), h(3)], [a]) == {a: 2}
    assert index.match([h(1), h(9)], [a]) == {a: 2}
