"""Progress lines of a server's start: each phase (database, model load, kernel build
and probes, KV cache, warm-up, semantic cache) logs one INFO line when it begins and
one with its duration when it ends, under the ``kvtoll.start`` logger:

    INFO kvtoll.start start: model load ...
    INFO kvtoll.start start: model load done in 1.1 s
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

log = logging.getLogger("kvtoll.start")


@contextlib.contextmanager
def start_phase(name: str) -> Iterator[None]:
    """Log the beginning and the duration of the start phase ``name``."""
    log.info("start: %s ...", name)
    began = time.perf_counter()
    yield
    log.info("start: %s done in %.1f s", name, time.perf_counter() - began)
