"""Free queue: order and O(1) unlinking, against a plain Python list model."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.kv.free_queue import BlockId, FreeBlockQueue, KVBlock


def _blocks(n: int) -> list[KVBlock]:
    return [KVBlock(BlockId(i)) for i in range(n)]


def test_popleft_order_and_remove_from_middle() -> None:
    blocks = _blocks(4)
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3]
    assert q.popleft().block_id == 0
    q.append(blocks[0])
    q.appendleft(blocks[2])
    assert [b.block_id for b in q] == [2, 1, 3, 0]
    assert len(q) == 4


def test_double_insert_and_foreign_remove_are_errors() -> None:
    blocks = _blocks(2)
    q = FreeBlockQueue(blocks[:1])
    with pytest.raises(RuntimeError):
        q.append(blocks[0])
    with pytest.raises(RuntimeError):
        q.remove(blocks[1])
    q.popleft()
    with pytest.raises(RuntimeError):
        q.popleft()


@given(
    st.lists(
        st.tuples(st.sampled_from(["append", "appendleft", "remove", "pop"]), st.integers(0, 7))
    )
)
def test_matches_list_model(ops: list[tuple[str, int]]) -> None:
    blocks = _blocks(8)
    q = FreeBlockQueue(blocks)
    model = list(range(8))
    for op, i in ops:
        b = blocks[i]
        if op == "pop" and model:
            assert q.popleft().block_id == model.pop(0)
        elif op == "remove" and i in model:
            q.remove(b)
            model.remove(i)
        elif op == "append" and i not in model:
            q.append(b)
            model.append(i)
        elif op == "appendleft" and i not in model:
            q.appendleft(b)
            model.insert(0, i)
        assert [x.block_id for x in q] == model
        assert len(q) == len(model)
        assert all(blk.in_free_queue == (blk.block_id in model) for blk in blocks)
