"""Blocking calls that may hang (a database whose packets are dropped) run here: each
on a daemon thread of its own, so a hung call ties up that thread only, never a
shared pool's, and never holds the process at exit (``concurrent.futures`` joins its
threads at exit; these are not joined)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def in_daemon_thread(fn: Callable[[], T], name: str = "kvtoll-call") -> asyncio.Future[T]:
    """``fn()`` on a new daemon thread; its result (or exception) as a future of the
    running loop. Cancelling the future abandons the call (the thread runs on)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(ok: bool, value: object) -> None:
        if future.done():
            return
        if ok:
            future.set_result(value)  # type: ignore[arg-type]
        else:
            assert isinstance(value, BaseException)
            future.set_exception(value)

    def target() -> None:
        try:
            result: object = fn()
            ok = True
        except BaseException as exc:  # handed to the awaiting side
            result, ok = exc, False
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(settle, ok, result)

    threading.Thread(target=target, name=name, daemon=True).start()
    return future
