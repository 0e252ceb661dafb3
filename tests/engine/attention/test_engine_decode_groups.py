"""Decode rows grouped by context length: a partition, optimal under its cost model."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.attention.decode_groups import group_by_length


def _cost(groups: list[list[int]], blocks: dict[int, int], group_cost: int) -> int:
    return sum(len(g) * max(blocks[r] for r in g) + group_cost for g in groups)


def test_two_length_clusters_make_two_groups() -> None:
    rows = list(range(20))
    nbs = [2] * 10 + [50] * 10
    groups = group_by_length(rows, nbs, group_cost=64)
    assert [sorted(g) for g in groups] == [list(range(10)), list(range(10, 20))]


def test_equal_lengths_make_one_group_and_empty_makes_none() -> None:
    assert group_by_length([3, 1, 2], [5, 5, 5], group_cost=1) == [[3, 1, 2]]
    assert group_by_length([], [], group_cost=1) == []


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(1, 30), min_size=1, max_size=8),  # repeats: runs of one length
    st.integers(0, 60),
)
def test_partition_is_complete_and_no_contiguous_split_is_cheaper(
    nbs: list[int], group_cost: int
) -> None:
    rows = [10 + i for i in range(len(nbs))]
    blocks = dict(zip(rows, nbs, strict=True))
    groups = group_by_length(rows, nbs, group_cost)
    assert sorted(r for g in groups for r in g) == rows
    # brute force over every split of the length-sorted rows
    order = sorted(rows, key=lambda r: blocks[r])
    best = min(
        _cost([order[a:b] for a, b in itertools.pairwise((0, *c, len(order)))], blocks, group_cost)
        for k in range(len(order))
        for c in itertools.combinations(range(1, len(order)), k)
    )
    assert _cost(groups, blocks, group_cost) == best
