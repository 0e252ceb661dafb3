"""What the gateway calls on its optional plug-ins: the semantic cache and the router.

The request flow (:mod:`proxy.service`) depends only on these Protocols (the semantic
cache's with the types of :mod:`proxy.semantic.types`, which the flow uses as they
are); the semantic-cache and routing packages provide objects that satisfy them
(:class:`proxy.semantic.gateway.SemanticCacheAdapter`, the routing stack), handed to
:func:`proxy.app.create_app` (``semantic=``, ``router=``, ``fleet=``). Both are optional: with
no semantic cache every request goes upstream, with no router the first healthy
upstream (in the order given) is tried first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from proxy.semantic.types import SemanticAnswer, SemanticHit, SemanticProbe, SemanticQuery
from proxy.upstream.base import Upstream, UpstreamRequest, UpstreamUsage

if TYPE_CHECKING:
    from proxy.metrics import ProxyMetrics
    from proxy.pool import UpstreamPool


class SemanticCacheHook(Protocol):
    """The semantic cache as the gateway sees it."""

    async def lookup(self, query: SemanticQuery) -> SemanticHit | SemanticProbe | None:
        """A verified hit for ``query`` in its tenant's partition, a would-be hit to
        answer from the engine and check (explored, or held back by the error bound),
        or ``None``."""
        ...

    async def store(self, query: SemanticQuery, answer: SemanticAnswer) -> None:
        """Remember ``answer`` for ``query`` (the cache may decline)."""
        ...

    async def check(
        self, query: SemanticQuery, probe: SemanticProbe, answer: SemanticAnswer
    ) -> None:
        """Compare the engine's complete ``answer`` with ``probe``'s stored one (evidence)."""
        ...


@runtime_checkable
class SemanticReport(Protocol):
    """A semantic cache that reports its error bound's figures (optional)."""

    def bind_metrics(self, registry: Any) -> None:
        """Register its collector on the app's Prometheus registry."""
        ...

    def bound_rows(self) -> list[dict[str, Any]]:
        """One row of figures per tenant, for the dashboards."""
        ...


class RouterHook(Protocol):
    """The router as the gateway sees it. Its bookkeeping is in memory and never waits,
    so its methods are plain calls: on the per-request path, no coroutine or cancel
    scope per call, and no cancellation can cut one short."""

    def rank(
        self, candidates: Sequence[Upstream], request: UpstreamRequest
    ) -> list[Upstream]:
        """``candidates`` (healthy upstreams) best first; the gateway tries them in order
        and moves on only while nothing has reached the client."""
        ...

    def started(self, upstream: Upstream, request: UpstreamRequest) -> None:
        """``upstream`` produced its first item for ``request`` (its prefill is done)."""
        ...

    def release(
        self, upstream: Upstream, request: UpstreamRequest, usage: UpstreamUsage | None = None
    ) -> None:
        """``request`` finished on ``upstream`` (success, error or abort); ``usage`` is the
        upstream's report when it sent one."""
        ...


class FleetHook(Protocol):
    """A manager of the worker fleet (the routing stack): it may add and remove the
    pool's upstreams as workers come and go, export its own metrics and describe the
    workers for the admin dashboard."""

    def bind(self, pool: UpstreamPool, metrics: ProxyMetrics) -> None:
        """Called once by :func:`proxy.app.create_app`, before the app starts."""
        ...

    def worker_rows(self) -> list[Mapping[str, object]]:
        """One row per worker (name, url, healthy, load...) for the admin dashboard."""
        ...
