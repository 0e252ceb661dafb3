"""The adapter between the gateway's semantic hook and the real semantic cache service
(MiniLM embedder, FAISS, verifier, in-process store)."""

from __future__ import annotations

import asyncio

from billing.models import TenantId
from proxy.semantic.factory import build_semantic_cache
from proxy.semantic.gateway import SemanticCacheAdapter
from proxy.semantic.types import SemanticAnswer, SemanticChoice, SemanticQuery


def _query(tenant: int, text: str) -> SemanticQuery:
    body = {"model": "m", "temperature": 0, "max_tokens": 32,
            "messages": [{"role": "user", "content": text}]}
    return SemanticQuery(tenant_id=TenantId(tenant), request_id="r", kind="chat", model="m",
                         body=body, threshold=None, allow_sampled=False)


def test_store_then_hit_per_tenant() -> None:
    cache = build_semantic_cache(None)
    adapter = SemanticCacheAdapter(cache)
    answer = SemanticAnswer(choices=(SemanticChoice("Paris.", "stop"),), prompt_tokens=9,
                            completion_tokens=2)

    async def scenario() -> None:
        try:
            question = "What is the capital of France?"
            assert await adapter.lookup(_query(1, question)) is None
            await adapter.store(_query(1, question), answer)
            hit = await adapter.lookup(_query(1, question))
            assert hit is not None
            assert hit.choices == (SemanticChoice("Paris.", "stop"),)
            assert hit.completion_tokens == 2 and hit.similarity > 0.99
            assert await adapter.lookup(_query(2, question)) is None  # other tenant
        finally:
            await cache.aclose()

    asyncio.run(scenario())
