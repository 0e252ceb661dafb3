"""The upstreams a gateway may use, with periodic health checks.

Every upstream starts healthy. A background task calls ``health()`` on each every
``interval_s`` seconds; a failed check, or a connection failure seen by a request,
marks it unhealthy until a later check passes. Candidates for a request are the
healthy upstreams in the configured order, or all of them if none is healthy (better
to try than to refuse outright). Upstreams can join (:meth:`UpstreamPool.add`) and
leave (:meth:`UpstreamPool.remove`) while serving: a fleet manager (the routing
stack following the worker registry) keeps the pool in step with live workers; a
request already streaming from a removed upstream finishes on it.
"""

from __future__ import annotations

import asyncio
import logging
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

    async def run_health_checks(self, interval_s: float) -> None:
        """Check forever every ``interval_s`` (cancel the task to stop)."""
        while True:
            await asyncio.sleep(interval_s)
            await self.check_all()

    async def aclose(self) -> None:
        for upstream in self._upstreams:
            await upstream.aclose()
