"""EmbedMemo: one computation per (tenant, text) while it is kept, none shared between
tenants, the least recently used out first."""

from __future__ import annotations

import asyncio

import numpy as np

from proxy.semantic.embed_memo import EmbedMemo


class Counting:
    def __init__(self) -> None:
        self.texts: list[str] = []

    async def __call__(self, text: str) -> np.ndarray:
        self.texts.append(text)
        return np.full(2, float(len(self.texts)), dtype=np.float32)


def test_a_kept_vector_is_not_computed_again_and_tenants_do_not_share() -> None:
    compute = Counting()
    memo = EmbedMemo(4, compute)

    async def run() -> None:
        first = await memo.embed("t1", "hello")
        assert (await memo.embed("t1", "hello") == first).all()
        other = await memo.embed("t2", "hello")  # the same text, another tenant
        assert not (other == first).all()

    asyncio.run(run())
    assert compute.texts == ["hello", "hello"] and len(memo) == 2


def test_the_least_recently_used_goes_first() -> None:
    compute = Counting()
    memo = EmbedMemo(2, compute)

    async def run() -> None:
        await memo.embed("t", "a")
        await memo.embed("t", "b")
        await memo.embed("t", "a")  # a is now the most recent
        await memo.embed("t", "c")  # b goes
        await memo.embed("t", "a")
        await memo.embed("t", "b")  # computed again

    asyncio.run(run())
    assert compute.texts == ["a", "b", "c", "b"] and len(memo) == 2


def test_size_zero_keeps_nothing() -> None:
    compute = Counting()
    memo = EmbedMemo(0, compute)
    asyncio.run(memo.embed("t", "a"))
    asyncio.run(memo.embed("t", "a"))
    assert compute.texts == ["a", "a"] and len(memo) == 0
