"""Keeps the gateway's upstream pool in step with the worker registry
(:class:`proxy.hooks.FleetHook`).

After each registry refresh, :meth:`FleetSync.sync` adds an upstream (built by the
``make_upstream`` factory: an ``HttpUpstream`` named by the worker id) for every
worker that announced itself in Redis (a verified registration) and passed an
authenticated probe, and is not in the pool yet, and removes the
ones it added whose announcement expired. Static workers (``--worker URL``) are the
pool's own upstreams and are never removed. Requests already streaming from a
removed worker finish on it (the pool hands out upstreams, it does not own streams).

It also registers the router's Prometheus collector on the app's registry and
describes the workers (health, load, indexed blocks) for the admin dashboard.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from proxy.metrics import ProxyMetrics
from proxy.pool import UpstreamPool
from proxy.routing.metrics import RoutingCollector
from proxy.routing.registry import WorkerInfo, WorkerRegistry
from proxy.routing.router import PrefixRouter
from proxy.routing.types import WorkerId, WorkerLoad
from proxy.upstream.base import Upstream

log = logging.getLogger(__name__)

UpstreamFactory = Callable[[WorkerId, str], Upstream]  # (worker id, url) -> upstream


def tenant_shares_text(load: WorkerLoad) -> str:
    """Each tenant's share of a worker's KV cache, largest first: ``acme 38% (76 of 200
    blocks, 76 reserved)``."""
    total = max(1, load.num_total_blocks)
    parts = []
    for tenant, cached, reserved in sorted(load.tenant_blocks, key=lambda t: -t[1]):
        kept = f", {reserved} reserved" if reserved else ""
        parts.append(f"{tenant or '?'} {100 * cached // total}% ({cached} of "
                     f"{load.num_total_blocks} blocks{kept})")
    return "; ".join(parts)


class FleetSync:
    """Follows ``registry`` into the pool it is bound to (see module doc)."""

    def __init__(
        self, registry: WorkerRegistry, router: PrefixRouter, make_upstream: UpstreamFactory
    ) -> None:
        self._registry = registry
        self._router = router
        self._make = make_upstream
        self._pool: UpstreamPool | None = None
        self._added: dict[WorkerId, Upstream] = {}

    def bind(self, pool: UpstreamPool, metrics: ProxyMetrics) -> None:
        """Follow into ``pool`` from now on; export routing metrics on ``metrics``."""
        self._pool = pool
        metrics.registry.register(RoutingCollector(self._router, self._registry))

    async def sync(self) -> None:
        """Add newly announced workers to the pool, remove the departed ones."""
        if self._pool is None:
            return
        known = {w.worker_id: w for w in self._registry.workers()}
        in_pool = {u.name for u in self._pool.upstreams}
        for worker_id, info in known.items():
            if info.source == "redis" and info.healthy and worker_id not in in_pool:
                upstream = self._make(worker_id, info.url)
                self._pool.add(upstream)
                self._added[worker_id] = upstream
        for worker_id in [w for w in self._added if w not in known]:
            upstream = self._added.pop(worker_id)
            self._pool.remove(upstream.name)
            try:
                await upstream.aclose()
            except Exception:
                log.debug("closing departed upstream %s failed", worker_id, exc_info=True)

    def worker_rows(self) -> list[Mapping[str, object]]:
        """One row per pool upstream, with what the registry knows of it."""
        if self._pool is None:
            return []
        return [self._row(u.name, self._registry.get(WorkerId(u.name)))
                for u in self._pool.upstreams]

    def _row(self, name: str, info: WorkerInfo | None) -> Mapping[str, object]:
        assert self._pool is not None
        healthy = self._pool.is_healthy(name) and (info is None or info.healthy)
        row: dict[str, object] = {"name": name, "healthy": healthy}
        if info is None:
            return row
        load = info.load
        return {
            **row,
            "url": info.url,
            "source": info.source,
            "kv_events": info.kv_events,
            "running": load.num_running,
            "waiting": load.num_waiting,
            "free_blocks": f"{load.num_free_blocks}/{load.num_total_blocks}",
            "pending_prefill_tokens": self._router.pending_tokens(WorkerId(name)),
            "indexed_blocks": self._router.precise.num_blocks(WorkerId(name)),
            "kv_by_tenant": tenant_shares_text(load),
        }
