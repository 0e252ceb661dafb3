"""The semantic cache as the gateway uses it: a :class:`proxy.hooks.SemanticCacheHook`
(lookups and stores by :class:`~proxy.semantic.types.SemanticQuery`) and a resource the
app starts and closes."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry

from proxy.semantic.report import BoundCollector, bound_rows
from proxy.semantic.service import SemanticCache
from proxy.semantic.types import SemanticAnswer, SemanticHit, SemanticProbe, SemanticQuery


class SemanticCacheAdapter:
    """``cache`` behind the gateway's hook. ``follow``: on start, load the mirror and
    follow the other replicas' changes (a shared store); else only load it."""

    def __init__(self, cache: SemanticCache, *, follow: bool = False) -> None:
        self.cache = cache
        self._follow = follow
        self._names: dict[str, str] = {}  # tenant id -> name, for the figures

    def bind_metrics(self, registry: CollectorRegistry) -> None:
        """Export the error bound's per-tenant figures on ``registry`` (/metrics)."""
        registry.register(BoundCollector(self.bound_rows))

    def bound_rows(self) -> list[dict[str, Any]]:
        """The error bound's figures, one row per tenant (dashboards)."""
        return bound_rows(self.cache.stats, self._names)

    async def lookup(self, query: SemanticQuery) -> SemanticHit | SemanticProbe | None:
        """The cache's verified hit for ``query``, its probe (to check), or None."""
        if query.tenant_name:
            self._names[str(query.tenant_id)] = query.tenant_name
        result = await self.cache.lookup_detailed(
            query.tenant_id, query.body, allow_sampled=query.allow_sampled,
            threshold=query.threshold, request_id=query.request_id,
            max_error_rate=query.max_error_rate,
        )  # fmt: skip
        return result.hit or result.probe

    async def check(
        self, query: SemanticQuery, probe: SemanticProbe, answer: SemanticAnswer
    ) -> None:
        """Record whether the engine's answer confirmed the probe's stored one."""
        texts = tuple(c.text for c in answer.choices)
        await self.cache.evidence.check_probe(query.tenant_id, probe, texts)

    async def store(self, query: SemanticQuery, answer: SemanticAnswer) -> None:
        """Offer a complete answer, stored as the OpenAI object a client received."""
        if query.capacity is not None:
            self.cache.set_capacity(query.tenant_id, query.capacity)
        await self.cache.store(query.tenant_id, query.body,
                               answer.as_response(query.kind, query.model),
                               allow_sampled=query.allow_sampled)

    async def start(self) -> None:
        await (self.cache.start() if self._follow else self.cache.load())

    async def aclose(self) -> None:
        await self.cache.aclose()
