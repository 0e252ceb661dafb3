"""Log set-up of the long-running commands (``kvtoll serve``, ``kvtoll worker``).

At INFO a server logs at most one line per request it serves (uvicorn's access line,
when ``KVTOLL_ACCESS_LOG=1``) and what happens at start-up; two sources would flood it:

- the gateway polls every worker's ``/load`` and ``/kv/events`` several times a second
  through httpx, which logs each request at INFO, and a worker's access log records
  each poll it answers: :class:`PollFilter` moves those lines to DEBUG;
- faiss probes its AVX-512 / AVX2 builds at import and logs each miss
  (``ModuleNotFoundError``) at INFO: its loader logs only warnings, except at DEBUG.
"""

from __future__ import annotations

import logging
import re

POLL_LOGGERS = ("httpx", "uvicorn.access")
QUIET_LOGGERS = ("faiss.loader",)
# a worker poll's path, as it appears in httpx's and uvicorn's request lines
_POLL_PATH = re.compile(r"(?:^|[\s/\"]|//[^/\s]+)(?:/load|/kv/events)(?=[?\s\"]|$)")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


class PollFilter(logging.Filter):
    """Log request lines of worker polls at DEBUG (dropped unless DEBUG is on)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO or not _POLL_PATH.search(record.getMessage()):
            return True
        if not logging.getLogger(record.name).isEnabledFor(logging.DEBUG):
            return False
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


def is_poll_line(message: str) -> bool:
    """Whether ``message`` is a request line of a worker poll (``/load``, ``/kv/events``)."""
    return _POLL_PATH.search(message) is not None


def configure_logging(level: str) -> None:
    """Root logging at ``level`` plus the two quieting rules of the module doc."""
    numeric = logging.getLevelName(level.upper())
    logging.basicConfig(level=numeric, format=LOG_FORMAT)
    for name in POLL_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, PollFilter) for f in logger.filters):
            logger.addFilter(PollFilter())
    for name in QUIET_LOGGERS:
        if numeric != logging.DEBUG:
            logging.getLogger(name).setLevel(logging.WARNING)
