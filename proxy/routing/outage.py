"""One log line per outage of a background loop (a Redis poller, a registry refresh).

A loop that fails on every round while a dependency is down would otherwise log a
traceback each time: :class:`OutageLog` logs the first failure as one WARNING line,
the failures after it at DEBUG, and the first success after them as one INFO line.
"""

from __future__ import annotations

import logging


class OutageLog:
    """The outage state of one loop, named ``what`` in its lines (owned by the loop)."""

    def __init__(self, logger: logging.Logger, what: str) -> None:
        self._log = logger
        self._what = what
        self.failing = False

    def failed(self, exc: BaseException) -> None:
        if not self.failing:
            self._log.warning("%s failed (%s: %s); retrying quietly", self._what,
                              type(exc).__name__, exc)
        else:
            self._log.debug("%s still failing", self._what, exc_info=True)
        self.failing = True

    def ok(self) -> None:
        if self.failing:
            self._log.info("%s works again", self._what)
        self.failing = False
