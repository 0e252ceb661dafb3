"""Semantic-cache stores run in the background, after a response went out.

Storing embeds the prompt, which takes milliseconds; the client never waits for it.
Misses can arrive faster than they can be embedded, so the number of stores waiting
is capped: past ``limit`` an answer (already served and metered) is not offered to the
cache, and ``shed`` counts it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from proxy.hooks import SemanticCacheHook
from proxy.semantic.types import SemanticAnswer, SemanticProbe, SemanticQuery

log = logging.getLogger(__name__)


class BackgroundStores:
    """At most ``limit`` semantic-cache stores in flight; ``aclose`` waits for them."""

    def __init__(self, cache: SemanticCacheHook, limit: int, shed: Callable[[], None]) -> None:
        self._cache = cache
        self._limit = limit
        self._shed = shed
        self._tasks: set[asyncio.Task[None]] = set()

    def offer(self, query: SemanticQuery, answer: SemanticAnswer) -> bool:
        """Start storing ``answer`` unless ``limit`` stores are already waiting."""
        if len(self._tasks) >= self._limit:
            self._shed()
            return False
        task = asyncio.create_task(self._store(query, answer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    def check(self, query: SemanticQuery, probe: SemanticProbe, answer: SemanticAnswer) -> bool:
        """Start comparing the engine's ``answer`` with ``probe`` (same cap as stores)."""
        if len(self._tasks) >= self._limit:
            self._shed()
            return False
        task = asyncio.create_task(self._check(query, probe, answer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def _check(
        self, query: SemanticQuery, probe: SemanticProbe, answer: SemanticAnswer
    ) -> None:
        try:
            await self._cache.check(query, probe, answer)
        except Exception:
            log.exception("semantic cache check failed")

    async def _store(self, query: SemanticQuery, answer: SemanticAnswer) -> None:
        try:
            await self._cache.store(query, answer)
        except Exception:
            log.exception("semantic cache store failed")

    async def aclose(self) -> None:
        """Wait for the stores in flight to finish."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
