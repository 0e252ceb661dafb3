"""Conversions between the request flow and the semantic-cache hook's dataclasses."""

from __future__ import annotations

from proxy.hooks import SemanticAnswer, SemanticChoice, SemanticHit, SemanticQuery
from proxy.intake import Prepared
from proxy.tally import Item, Tally
from proxy.upstream.base import UpstreamDelta, UpstreamUsage


def query_of(prep: Prepared) -> SemanticQuery:
    """What the semantic cache is asked for ``prep`` (tenant from the key, never the body)."""
    return SemanticQuery(
        tenant_id=prep.identity.tenant_id,
        kind=prep.kind,
        model=prep.model,
        body=prep.body,
        threshold=prep.identity.semantic_threshold,
        allow_sampled=prep.identity.semantic_allow_sampled,
    )


def hit_items(hit: SemanticHit, prompt_tokens: int) -> list[Item]:
    """A hit replayed as upstream items: one delta per choice, then the usage (the whole
    prompt counts as cached: no prefill happened)."""
    items: list[Item] = [
        UpstreamDelta(index=i, text=c.text, finish_reason=c.finish_reason)
        for i, c in enumerate(hit.choices)
    ]
    items.append(
        UpstreamUsage(
            prompt_tokens=prompt_tokens,
            completion_tokens=hit.completion_tokens,
            cached_tokens=prompt_tokens,
        )
    )
    return items


def answer_of(tally: Tally, prompt_tokens: int) -> SemanticAnswer:
    """A complete upstream answer as offered to the cache."""
    choices = tuple(
        SemanticChoice(text=c.text, finish_reason=c.finish_reason or "stop")
        for c in tally.choices()
    )
    usage = tally.usage
    return SemanticAnswer(
        choices=choices,
        prompt_tokens=usage.prompt_tokens if usage else prompt_tokens,
        completion_tokens=tally.completion_tokens(),
    )
