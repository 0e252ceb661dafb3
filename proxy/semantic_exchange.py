"""What passes between the gateway's request flow and the semantic cache: the query a
prepared request asks, a hit replayed as upstream items, and a complete upstream
answer as offered to the cache (:mod:`proxy.service` drives the flow)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from proxy.intake import Prepared
from proxy.semantic.capacity import TenantCapacity
from proxy.semantic.types import SemanticAnswer, SemanticChoice, SemanticHit, SemanticQuery
from proxy.tally import Item, Tally
from proxy.upstream.base import UpstreamDelta, UpstreamUsage


def semantic_query(prep: Prepared) -> SemanticQuery:
    """What the semantic cache is asked for ``prep`` (tenant from the key, never the body)."""
    return SemanticQuery(
        tenant_id=prep.identity.tenant_id, request_id=prep.request_id, kind=prep.kind,
        model=prep.model, body=prep.body, threshold=prep.identity.semantic_threshold,
        allow_sampled=prep.identity.semantic_allow_sampled,
        capacity=TenantCapacity(prep.identity.semantic_max_entries,
                                prep.identity.semantic_max_bytes),
        max_error_rate=prep.identity.semantic_max_error_rate,
        tenant_name=prep.identity.tenant_name,
    )  # fmt: skip


async def replay_hit(hit: SemanticHit, prompt_tokens: int) -> AsyncIterator[Item]:
    """A hit as upstream items: one delta per choice, then the usage (the whole prompt
    counts as cached: no prefill happened)."""
    for i, choice in enumerate(hit.choices):
        yield UpstreamDelta(index=i, text=choice.text, finish_reason=choice.finish_reason)
    yield UpstreamUsage(prompt_tokens=prompt_tokens, completion_tokens=hit.completion_tokens,
                        cached_tokens=prompt_tokens)  # fmt: skip


def cache_answer(tally: Tally, prompt_tokens: int) -> SemanticAnswer:
    """A complete upstream answer as offered to the cache."""
    choices = tuple(SemanticChoice(c.text, c.finish_reason or "stop") for c in tally.choices())
    prompt = tally.usage.prompt_tokens if tally.usage else prompt_tokens
    return SemanticAnswer(choices=choices, completion_tokens=tally.completion_tokens(),
                          prompt_tokens=prompt)  # fmt: skip
