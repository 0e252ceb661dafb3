"""MicroBatcher: texts that arrive while a batch runs go together as the next batch."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import numpy as np
import pytest

from proxy.semantic.embedder import MicroBatcher


class GatedEmbedder:
    """A stand-in model (the batcher is under test) that blocks until released."""

    dim = 4
    name = "gated"

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.release = threading.Event()

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        self.batches.append(list(texts))
        self.release.wait(timeout=10)
        return np.array([[float(len(t)), 0, 0, 0] for t in texts], dtype=np.float32)


@pytest.mark.anyio
async def test_texts_queued_behind_a_running_batch_form_one_next_batch() -> None:
    model = GatedEmbedder()
    batcher = MicroBatcher(model, max_batch=8, max_wait_ms=0.5)
    first = asyncio.create_task(batcher.embed_one("a"))
    while not model.batches:  # the first batch is running (blocked in the model)
        await asyncio.sleep(0.001)
    later = []
    for n in range(1, 11):  # arrivals spread out, each far apart compared to max_wait
        later.append(asyncio.create_task(batcher.embed_one("b" * n)))
        await asyncio.sleep(0.005)
    assert len(model.batches) == 1  # no second batch started while the first runs
    model.release.set()
    vectors = await asyncio.gather(first, *later)
    assert [len(b) for b in model.batches] == [1, 8, 2]  # queued together, capped at max_batch
    assert [float(v[0]) for v in vectors] == [1.0, *range(1, 11)]
    batcher.close()


@pytest.mark.anyio
async def test_an_idle_worker_starts_at_once_with_texts_of_the_same_turn() -> None:
    model = GatedEmbedder()
    model.release.set()
    batcher = MicroBatcher(model, max_batch=8)  # max_wait_ms=0: no waiting for company
    together = [asyncio.create_task(batcher.embed_one(t)) for t in ("a", "bb", "ccc")]
    await asyncio.sleep(0)  # the three tasks queue their texts in this turn
    assert batcher.num_waiting == 3
    await asyncio.sleep(0)  # next turn: handed to the model, no timer involved
    assert batcher.num_waiting == 0
    await asyncio.gather(*together)
    alone = await asyncio.wait_for(batcher.embed_one("dddd"), timeout=5)
    assert model.batches == [["a", "bb", "ccc"], ["dddd"]]
    assert float(alone[0]) == 4.0
    with pytest.raises(ValueError):
        MicroBatcher(model, max_wait_ms=-1)
    batcher.close()


@pytest.mark.anyio
async def test_two_workers_run_two_batches_and_share_what_waits_evenly() -> None:
    model = GatedEmbedder()
    batcher = MicroBatcher(model, max_batch=8, workers=2)
    same_turn = [asyncio.create_task(batcher.embed_one(t)) for t in "abcdef"]
    while len(model.batches) < 2:  # both workers busy (blocked in the model)
        await asyncio.sleep(0.001)
    assert sorted(len(b) for b in model.batches) == [3, 3]  # shared, not 6 + 0
    assert batcher.max_running == 2
    queued = [asyncio.create_task(batcher.embed_one("x" * n)) for n in range(1, 5)]
    for _ in range(20):
        await asyncio.sleep(0.001)
    assert len(model.batches) == 2 and batcher.num_waiting == 4  # no third batch
    model.release.set()
    vectors = await asyncio.gather(*same_turn, *queued)
    assert [float(v[0]) for v in vectors] == [1.0] * 6 + [1.0, 2.0, 3.0, 4.0]
    assert sum(len(b) for b in model.batches) == 10 and batcher.max_running == 2
    with pytest.raises(ValueError):
        MicroBatcher(model, workers=0)
    with pytest.raises(ValueError):
        MicroBatcher(model, threads_per_worker=0)
    batcher.close()
