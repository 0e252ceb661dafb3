"""A timeout for each of many successive awaits (the items of one stream), one timer.

``asyncio.timeout()`` around every await creates a ``Timeout``, schedules a timer
handle (heap push) and cancels it again: per streamed item, on the gateway's hot
path. :class:`StepTimer` keeps at most one handle scheduled and moves only a
deadline per await; when the handle fires before the current deadline (the await
it was armed for ended and a later one started) it is re-armed for that deadline.
An await that outlasts its limit is cancelled and raises ``TimeoutError``, exactly
as with ``asyncio.timeout`` (a cancellation from elsewhere stays a cancellation)::

    timer = StepTimer()
    with timer(first_byte_s):
        first = await anext(stream)
    with timer(idle_s):
        item = await anext(stream)
    timer.close()
"""

from __future__ import annotations

import asyncio
from types import TracebackType


class StepTimer:
    """Reusable per-await timeout (see module doc); use from one task at a time."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._handle: asyncio.TimerHandle | None = None
        self._limit_s = 0.0
        self._deadline = 0.0
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0
        self._expired = False

    def __call__(self, limit_s: float) -> StepTimer:
        """Set the limit of the next ``with`` block."""
        self._limit_s = limit_s
        return self

    def __enter__(self) -> StepTimer:
        task = asyncio.current_task(self._loop)
        if task is None:
            raise RuntimeError("StepTimer must be used inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        self._expired = False
        self._deadline = self._loop.time() + self._limit_s
        if self._handle is None:
            self._handle = self._loop.call_at(self._deadline, self._fire)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        task, self._task = self._task, None
        if not self._expired or task is None:
            return
        # as asyncio.Timeout.__aexit__: undo our cancel; only it becomes a TimeoutError
        if task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
            raise TimeoutError from exc

    def _fire(self) -> None:
        self._handle = None
        if self._task is None:
            return  # between two awaits: the next one schedules a handle again
        if self._loop.time() < self._deadline:
            self._handle = self._loop.call_at(self._deadline, self._fire)
            return
        self._expired = True
        self._task.cancel()

    def close(self) -> None:
        """Cancel the scheduled handle (call when no await is left)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
