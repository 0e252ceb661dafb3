"""The worker process of bench/noisy_neighbour.py: one kvtoll worker app and its engine.

The bench's clients (A's and B's requests, JSON and SSE parsing) run in the bench's
process; the worker runs here, in a process of its own started with ``spawn``, as a
deployed ``kvtoll worker`` does. In one process the clients' event-loop work shared the
GIL with the engine's step thread and the server, and A's TTFT measured that contention
(client-side TTFT p50 151 ms against 31 ms from the engine's submission to its first
token in one flood phase), not the engine's scheduling.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.synchronize import Event
from typing import Any

from engine.config import EngineConfig

START_TIMEOUT_S = 300.0


@contextmanager
def worker_process(config: EngineConfig) -> Iterator[tuple[str, str]]:
    """Start a worker for ``config`` in a child process; yields (base URL, model name)
    and stops the child on exit."""
    ctx = mp.get_context("spawn")
    started: mp.Queue[Any] = ctx.Queue()
    stop = ctx.Event()
    proc = ctx.Process(target=_serve, args=(config, started, stop), daemon=True)
    proc.start()
    try:
        got = started.get(timeout=START_TIMEOUT_S)
        if isinstance(got, str):
            raise RuntimeError(f"noisy-neighbour worker failed to start: {got}")
        yield got
    finally:
        stop.set()
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join()


def _serve(config: EngineConfig, started: mp.Queue[Any], stop: Event) -> None:
    try:
        asyncio.run(_serve_async(config, started, stop))
    except Exception as exc:  # the parent waits on the queue: tell it, then fail
        started.put(f"{type(exc).__name__}: {exc}")
        raise


async def _serve_async(config: EngineConfig, started: mp.Queue[Any], stop: Event) -> None:
    from engine.factory import build_engine
    from engine.serving.app import build_worker_app
    from kvtoll.server import serve_in_background

    engine = build_engine(config)
    try:
        async with serve_in_background(build_worker_app(engine)) as url:
            started.put((url, engine.model_name))
            while not stop.is_set():
                await asyncio.sleep(0.1)
    finally:
        engine.shutdown()
