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
