"""Per-thread limit of torch's intra-op threads (the embedder's workers use it)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import pytest
import torch

from proxy.semantic.omp_threads import _torch_openmp_library, limit_this_thread

T = TypeVar("T")


def _in_thread(fn: Callable[[], T]) -> T:
    box: list[T] = []
    thread = threading.Thread(target=lambda: box.append(fn()))
    thread.start()
    thread.join()
    return box[0]


def test_the_limit_holds_in_its_thread_only() -> None:
    if _torch_openmp_library() is None:
        pytest.skip("torch does not run on an OpenMP runtime of its own here")
    # Other tests may have set this thread's count apart from the process-wide one
    # (which new threads start from): compare each with itself.
    before, fresh = torch.get_num_threads(), _in_thread(torch.get_num_threads)

    def limited() -> tuple[bool, int, float]:
        ok = limit_this_thread(1)
        x = torch.randn(64, 64)
        return ok, torch.get_num_threads(), float((x @ x).sum())  # ops still run

    ok, inside, _ = _in_thread(limited)
    assert ok and inside == 1
    assert torch.get_num_threads() == before  # this thread: untouched
    assert _in_thread(torch.get_num_threads) == fresh  # a new thread: untouched


def test_a_limit_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="num_threads"):
        limit_this_thread(0)
