"""The upstreams a gateway may use, with periodic health checks.

Every upstream starts healthy; the app runs one round of checks before serving, so
a worker unreachable at start is down from the first request on (the gateway starts
with any subset of its workers up). A background task calls ``health()`` on each
healthy upstream every ``interval_s`` seconds; a failed check, or a failure seen by
a request (refused, cut, silent past its timeout), marks it unhealthy at once. A
down upstream is re-probed with backoff: after ``min_backoff_s``, then twice as
long each time, at most ``interval_s``; the first check that passes brings it back.
Candidates for a request are the healthy upstreams in the configured order, or all
of them if none is healthy (better to try than to refuse outright). Upstreams can
join (:meth:`UpstreamPool.add`) and leave (:meth:`UpstreamPool.remove`) while
serving: a fleet manager (the routing stack following the worker registry) keeps the
pool in step with live workers; a request already streaming from a removed upstream
finishes on it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from proxy.metrics import ProxyMetrics
from proxy.upstream.base import ReportsUsageProblems, Upstream

log = logging.getLogger(__name__)
HEALTH_CHECK_TIMEOUT_S = 2.0


class UpstreamPool:
    """Ordered upstreams plus their last known health."""

    def __init__(self, upstreams: Sequence[Upstream], metrics: ProxyMetrics) -> None:
        if not upstreams:
            raise ValueError("at least one upstream is required")
        names = [u.name for u in upstreams]
        if len(set(names)) != len(names):
            raise ValueError(f"upstream names must be unique, got {names}")
        self._upstreams = tuple(upstreams)
        self._metrics = metrics
        self._healthy = dict.fromkeys(names, True)
        self._next_check: dict[str, float] = {}  # name -> monotonic time of its next probe
        self._backoff: dict[str, float] = {}  # name -> wait before the next probe while down
        self._min_backoff_s = 0.5
        for name in names:
            metrics.upstream_healthy.labels(name).set(1)

    @property
    def upstreams(self) -> tuple[Upstream, ...]:
        return self._upstreams

    def is_healthy(self, name: str) -> bool:
        """The last known health of the upstream called ``name`` (False if unknown)."""
        return self._healthy.get(name, False)

    def add(self, upstream: Upstream) -> None:
        """Append ``upstream`` (healthy until a check says otherwise); its name must be new."""
        if upstream.name in self._healthy:
            raise ValueError(f"upstream {upstream.name!r} is already in the pool")
        self._upstreams = (*self._upstreams, upstream)
        self._healthy[upstream.name] = True
        self._metrics.upstream_healthy.labels(upstream.name).set(1)
        log.info("upstream %s joined the pool", upstream.name)

    def remove(self, name: str) -> Upstream | None:
        """Take the upstream called ``name`` out of the pool (the caller closes it)."""
        found = next((u for u in self._upstreams if u.name == name), None)
        if found is None:
            return None
        self._upstreams = tuple(u for u in self._upstreams if u.name != name)
        del self._healthy[name]
        self._next_check.pop(name, None)
        self._backoff.pop(name, None)
        self._metrics.upstream_healthy.remove(name)
        log.info("upstream %s left the pool", name)
        return found

    def candidates(self) -> list[Upstream]:
        """Healthy upstreams in order, or every upstream if none is healthy."""
        healthy = [u for u in self._upstreams if self._healthy[u.name]]
        return healthy or list(self._upstreams)

    def any_healthy(self) -> bool:
        return any(self._healthy.values())

    def usage_problems(self) -> list[str]:
        """Each upstream's reason its cached tokens cannot be billed, if it has one."""
        return [problem for u in self._upstreams
                if isinstance(u, ReportsUsageProblems) and (problem := u.usage_problem())]

    def mark(self, upstream: Upstream, healthy: bool) -> None:
        """Record the outcome of a health check or of a failed connection."""
        if upstream.name not in self._healthy:
            return  # removed meanwhile
        if self._healthy[upstream.name] != healthy:
            log.info("upstream %s is now %s", upstream.name, "healthy" if healthy else "DOWN")
            if not healthy:  # probe it again soon, then back off
                self._backoff[upstream.name] = self._min_backoff_s
                self._next_check[upstream.name] = time.monotonic() + self._min_backoff_s
        self._healthy[upstream.name] = healthy
        self._metrics.upstream_healthy.labels(upstream.name).set(int(healthy))

    async def check_all(self) -> None:
        """Run one health check on every upstream, concurrently."""
        upstreams = self._upstreams
        results = await asyncio.gather(*(self._check(u) for u in upstreams))
        for upstream, ok in zip(upstreams, results, strict=True):
            self.mark(upstream, ok)

    async def _check(self, upstream: Upstream) -> bool:
        try:
            async with asyncio.timeout(HEALTH_CHECK_TIMEOUT_S):
                return bool(await upstream.health())
        except Exception:
            return False

    async def run_health_checks(self, interval_s: float, min_backoff_s: float = 0.5) -> None:
        """Check forever: healthy upstreams every ``interval_s``, down ones with backoff
        (see module doc; cancel the task to stop)."""
        self._min_backoff_s = min_backoff_s = min(min_backoff_s, interval_s)
        now = time.monotonic()
        for u in self._upstreams:
            self._next_check.setdefault(u.name, now + interval_s)
        while True:
            await asyncio.sleep(min_backoff_s / 2)
            now = time.monotonic()
            due = [u for u in self._upstreams if now >= self._next_check.get(u.name, 0.0)]
            if not due:
                continue
            results = await asyncio.gather(*(self._check(u) for u in due))
            now = time.monotonic()
            for upstream, ok in zip(due, results, strict=True):
                name = upstream.name
                if name not in self._healthy:
                    continue  # removed meanwhile
                self.mark(upstream, ok)
                if ok:
                    self._backoff[name] = min_backoff_s
                    self._next_check[name] = now + interval_s
                else:
                    wait = self._backoff.get(name, min_backoff_s)
                    self._next_check[name] = now + wait
                    self._backoff[name] = min(wait * 2, interval_s)

    async def aclose(self) -> None:
        for upstream in self._upstreams:
            await upstream.aclose()
