"""FaissIndex against brute force: flat mode exactly, HNSW mode on small graphs."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.semantic.index import FaissIndex, IndexConfig

DIM = 8

# An operation: ("add", id, seed) or ("remove", id, 0).
ops_strategy = st.lists(
    st.tuples(
        st.sampled_from(["add", "add", "remove"]), st.integers(0, 40), st.integers(0, 10_000)
    ),
    max_size=60,
)


def unit(seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)
    return v / np.linalg.norm(v)


def replay(index: FaissIndex, ops: list[tuple[str, int, int]]) -> dict[int, np.ndarray]:
    model: dict[int, np.ndarray] = {}
    for op, item_id, seed in ops:
        if op == "add":
            model[item_id] = unit(seed)
            index.add(np.array([item_id], dtype=np.int64), model[item_id].reshape(1, -1))
        else:
            model.pop(item_id, None)
            index.remove(np.array([item_id], dtype=np.int64))
    return model


def brute_force(model: dict[int, np.ndarray], query: np.ndarray, k: int) -> list[float]:
    return sorted((float(v @ query) for v in model.values()), reverse=True)[:k]


@settings(max_examples=60, deadline=None)
@given(ops=ops_strategy, query_seed=st.integers(0, 10_000), k=st.integers(1, 8))
def test_flat_index_matches_brute_force(
    ops: list[tuple[str, int, int]], query_seed: int, k: int
) -> None:
    index = FaissIndex(DIM, IndexConfig(hnsw_threshold=10_000))
    model = replay(index, ops)
    query = unit(query_seed)
    got = index.search(query, k)
    assert len(index) == len(model)
    assert {i for i, _ in got} <= set(model)
    np.testing.assert_allclose([s for _, s in got], brute_force(model, query, k), atol=1e-5)
    for item_id, score in got:
        assert abs(float(model[item_id] @ query) - score) < 1e-5


@settings(max_examples=60, deadline=None)
@given(ops=ops_strategy, query_seed=st.integers(0, 10_000), k=st.integers(1, 8))
def test_hnsw_index_never_returns_removed_ids_and_scores_are_true(
    ops: list[tuple[str, int, int]], query_seed: int, k: int
) -> None:
    index = FaissIndex(
        DIM, IndexConfig(hnsw_threshold=4, hnsw_m=8, ef_search=64, rebuild_fraction=0.5)
    )
    model = replay(index, ops)
    query = unit(query_seed)
    got = index.search(query, k)
    assert len(index) == len(model)
    assert len(got) == min(k, len(model))
    assert [s for _, s in got] == sorted((s for _, s in got), reverse=True)
    for item_id, score in got:
        assert item_id in model
        assert abs(float(model[item_id] @ query) - score) < 1e-5
    # A stored vector is its own nearest neighbour (cosine 1).
    for item_id, vector in list(model.items())[:5]:
        best_id, best = index.search(vector, 1)[0]
        assert best > 0.9999 and (
            best_id == item_id or abs(float(model[best_id] @ vector) - 1) < 1e-5
        )


def test_switches_to_hnsw_past_threshold_and_back_after_removals() -> None:
    index = FaissIndex(DIM, IndexConfig(hnsw_threshold=10, rebuild_fraction=0.2))
    ids = np.arange(20, dtype=np.int64)
    index.add(ids, np.stack([unit(i) for i in range(20)]))
    assert index.is_hnsw
    index.remove(ids[:16])
    assert not index.is_hnsw and len(index) == 4
    assert {i for i, _ in index.search(unit(17), 10)} == {16, 17, 18, 19}


def test_re_adding_an_id_replaces_its_vector() -> None:
    index = FaissIndex(DIM)
    index.add(np.array([1], dtype=np.int64), unit(1).reshape(1, -1))
    index.add(np.array([1], dtype=np.int64), unit(2).reshape(1, -1))
    assert len(index) == 1
    assert index.search(unit(2), 1)[0][1] > 0.9999
