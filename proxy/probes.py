"""Background probes of the gateway's dependencies, read by ``/readyz``.

Every ``interval_s`` each probe runs once, concurrently, bounded by ``timeout_s``. A
probe that fails, or takes longer than ``timeout_s`` (a blackholed database answers
nothing, it does not refuse), marks its dependency down with the reason; a probe
still running from an earlier round counts as hanging (it is not started twice).
``/readyz`` never waits on a dependency itself: it reads the last results, so it
answers at once and notices an outage within ``interval_s + timeout_s``.

Probes: ``database`` (``SELECT 1`` on a thread of its own, so a hang ties up nothing
else) and, with ``KVTOLL_REDIS_URL``, ``redis`` (``PING`` with socket timeouts).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from proxy.threads import in_daemon_thread

log = logging.getLogger(__name__)
Probe = Callable[[], Awaitable[None]]


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    detail: str  # "ok", or why not
    since: float  # monotonic time of the last change


class DependencyProbes:
    """The last known state of each dependency (see module doc)."""

    def __init__(self, probes: Mapping[str, Probe], *, interval_s: float = 1.0,
                 timeout_s: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._probes = dict(probes)
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._clock = clock
        now = clock()
        self._results = {name: ProbeResult(True, "not probed yet", now) for name in probes}
        self._running: dict[str, asyncio.Task[None]] = {}
        self._started: dict[str, float] = {}

    def results(self) -> dict[str, ProbeResult]:
        return dict(self._results)

    def down(self) -> list[str]:
        """Names of the dependencies down now, in probe order."""
        return [name for name, r in self._results.items() if not r.ok]

    async def check_all(self) -> None:
        """One round of every probe (see module doc)."""
        await asyncio.gather(*(self._check(name) for name in self._probes))

    async def _check(self, name: str) -> None:
        running = self._running.get(name)
        if running is not None and not running.done():
            waited = self._clock() - self._started[name]
            self._set(name, False, f"no answer for {waited:.1f} s")
            return
        task = asyncio.ensure_future(self._probes[name]())
        self._running[name] = task
        self._started[name] = self._clock()
        done, _ = await asyncio.wait({task}, timeout=self._timeout_s)
        if not done:
            self._set(name, False, f"no answer within {self._timeout_s:g} s")
            return
        exc = task.exception()
        if exc is None:
            self._set(name, True, "ok")
        else:
            self._set(name, False, (str(exc).splitlines() or [type(exc).__name__])[0][:200])

    def _set(self, name: str, ok: bool, detail: str) -> None:
        old = self._results[name]
        if old.ok != ok:
            if ok:
                log.info("dependency %s is back", name)
            else:
                log.warning("dependency %s is down: %s", name, detail)
        since = old.since if old.ok == ok else self._clock()
        self._results[name] = ProbeResult(ok, detail, since)

    async def run(self) -> None:
        """Probe forever (cancel the task to stop)."""
        while True:
            await self.check_all()
            await asyncio.sleep(self._interval_s)

    async def aclose(self) -> None:
        for task in self._running.values():
            task.cancel()
        await asyncio.gather(*self._running.values(), return_exceptions=True)


def database_probe(factory: sessionmaker[Session]) -> Probe:
    """``SELECT 1`` on a daemon thread of its own (:mod:`proxy.threads`)."""

    def select_one() -> None:
        with factory() as session:
            session.execute(text("SELECT 1"))

    async def probe() -> None:
        await in_daemon_thread(select_one, "kvtoll-db-probe")

    return probe


def redis_probe(url: str, socket_timeout_s: float) -> tuple[Probe, Callable[[], Awaitable[Any]]]:
    """``PING`` on a client of its own; returns the probe and its (async) closer."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url, socket_timeout=socket_timeout_s,
                                     socket_connect_timeout=socket_timeout_s,
                                     retry_on_timeout=False)

    async def probe() -> None:
        await client.ping()

    return probe, client.aclose
