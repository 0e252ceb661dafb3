"""Conversions between the request flow and the semantic-cache hook's dataclasses, and
the adapter that makes the semantic cache service a :class:`~proxy.hooks.SemanticCacheHook`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from kvtoll.openai.responses import (
    ChoiceResult,
    ResponseMeta,
    chat_completion,
    text_completion,
    usage_dict,
)
from proxy.hooks import SemanticAnswer, SemanticChoice, SemanticHit, SemanticQuery
from proxy.intake import Prepared
from proxy.tally import Item, Tally
from proxy.upstream.base import UpstreamDelta, UpstreamUsage


def query_of(prep: Prepared) -> SemanticQuery:
    """What the semantic cache is asked for ``prep`` (tenant from the key, never the body)."""
    return SemanticQuery(
        tenant_id=prep.identity.tenant_id,
        request_id=prep.request_id,
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


class SemanticService(Protocol):
    """What :class:`SemanticCacheAdapter` needs of ``proxy.semantic.service.SemanticCache``."""

    async def lookup(
        self, tenant_id: str | int, body: Mapping[str, Any], *, allow_sampled: bool = False,
        threshold: float | None = None, request_id: str | None = None,
    ) -> Any: ...

    async def store(
        self, tenant_id: str | int, body: Mapping[str, Any], answer: Mapping[str, Any], *,
        allow_sampled: bool = False, allow_tool_calls: bool | None = None,
    ) -> Any: ...


class SemanticCacheAdapter:
    """:class:`~proxy.hooks.SemanticCacheHook` over the semantic cache service, which
    stores whole OpenAI response objects (``answer``) and returns hits carrying
    ``entry.answer`` and ``similarity``."""

    def __init__(self, service: SemanticService) -> None:
        self.service = service

    async def lookup(self, query: SemanticQuery) -> SemanticHit | None:
        """The service's verified hit, as replayable choices."""
        hit = await self.service.lookup(
            query.tenant_id, query.body, allow_sampled=query.allow_sampled,
            threshold=query.threshold, request_id=query.request_id,
        )
        if hit is None:
            return None
        answer: Mapping[str, Any] = hit.entry.answer
        choices = tuple(
            SemanticChoice(text=_choice_text(c), finish_reason=str(c.get("finish_reason")))
            for c in answer.get("choices", [])
        )
        usage = answer.get("usage") or {}
        return SemanticHit(
            choices=choices, similarity=float(hit.similarity),
            completion_tokens=int(usage.get("completion_tokens", 0)),
        )

    async def store(self, query: SemanticQuery, answer: SemanticAnswer) -> None:
        """Offer a complete answer as the OpenAI object a client received."""
        meta = ResponseMeta.new(query.kind, query.model)
        results = [
            ChoiceResult(index=i, text=c.text, finish_reason=c.finish_reason)
            for i, c in enumerate(answer.choices)
        ]
        usage = usage_dict(answer.prompt_tokens, answer.completion_tokens, 0)
        build = chat_completion if query.kind == "chat" else text_completion
        await self.service.store(
            query.tenant_id, query.body, build(meta, results, usage),
            allow_sampled=query.allow_sampled,
        )


def _choice_text(choice: Mapping[str, Any]) -> str:
    message = choice.get("message")
    if isinstance(message, Mapping):
        return str(message.get("content") or "")
    return str(choice.get("text") or "")
