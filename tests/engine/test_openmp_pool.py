"""Freeing the calling thread's OpenMP pool (engine.openmp_pool), in a fresh interpreter
so that no other test's threads are in the count: the pool's worker threads exit, and
the engine's step thread is started only after its starter's pool was freed."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine import async_engine
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.factory import build_llm_engine

ROOT = Path(__file__).resolve().parents[2]

FREE_POOL = """
import os, time
import torch
from engine.openmp_pool import release_thread_pool
torch.set_num_threads(2)
x = torch.randn(512, 512)
(x @ x).sum()  # a parallel op: this thread's pool of OpenMP workers exists now
before = len(os.listdir("/proc/self/task"))
released = release_thread_pool()
for _ in range(200):  # the workers exit on their own schedule
    after = len(os.listdir("/proc/self/task"))
    if after < before:
        break
    time.sleep(0.01)
ok = float((x @ x).sum()) == float((x @ x).sum())  # ops still run (a new pool)
print(released, before, after, ok)
"""


def test_the_calling_threads_workers_exit() -> None:
    import torch

    # the child sets its own two threads (this process's count may be another test's)
    if "OpenMP" not in torch.__config__.parallel_info() or (os.cpu_count() or 1) < 2:
        pytest.skip("needs torch on OpenMP and two or more CPUs")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(FREE_POOL)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    released, before, after, ok = proc.stdout.split()
    if released == "False":
        pytest.skip("torch's OpenMP runtime has no omp_pause_resource_all here")
    assert int(after) < int(before) and ok == "True"


def test_the_step_thread_starts_after_the_starters_pool_is_freed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    order: list[str] = []
    monkeypatch.setattr(async_engine, "release_thread_pool", lambda: order.append("released"))
    engine = AsyncEngine(build_llm_engine(EngineConfig.tiny()))
    real_run = engine._run
    monkeypatch.setattr(engine, "_run", lambda: (order.append("step thread"), real_run()))
    engine.start()
    engine.start()  # already running: nothing more
    asyncio.run(engine.close())
    assert order == ["released", "step thread"]
