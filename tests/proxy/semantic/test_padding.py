"""Length buckets: every text gets a fixed padded length of its own, whatever its batch."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.semantic.padding import bucket_length, length_groups, pad_rows


@given(st.integers(0, 600), st.integers(1, 32), st.one_of(st.none(), st.integers(1, 512)))
def test_bucket_holds_the_text_and_is_a_multiple_of_the_step(
    length: int, step: int, cap: int | None
) -> None:
    size = bucket_length(length, step, cap)
    assert size >= length
    assert size % step == 0 or (cap is not None and size == max(cap, length))
    assert size - length < step or length == 0 or size == step


@given(st.lists(st.integers(0, 200), max_size=60), st.lists(st.integers(0, 200), max_size=60))
def test_a_text_gets_the_same_bucket_in_any_batch(mine: list[int], others: list[int]) -> None:
    """The bucket of each length is the same alone and inside any other batch."""
    alone = {n: bucket_length(n) for n in mine}
    groups = length_groups(mine + others)
    seen: set[int] = set()
    for bucket, idx in groups:
        for i in idx:
            seen.add(i)
            if i < len(mine):
                assert bucket == alone[mine[i]]
    assert seen == set(range(len(mine) + len(others)))  # a partition of the batch


def test_pad_rows_masks_the_padding_and_refuses_overlong_rows() -> None:
    ids, mask = pad_rows([[5, 6], [7]], 4, pad_id=0)
    assert ids == [[5, 6, 0, 0], [7, 0, 0, 0]]
    assert mask == [[1, 1, 0, 0], [1, 0, 0, 0]]
    with pytest.raises(ValueError):
        pad_rows([[1, 2, 3]], 2)
