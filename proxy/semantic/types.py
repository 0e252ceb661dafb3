"""What crosses the seam between the gateway and the semantic cache: the query the
gateway asks (:class:`SemanticQuery`), the verified hit the cache answers with
(:class:`SemanticHit`, the one hit type from lookup to response), a would-be hit the
gateway answers from the engine to check it (:class:`SemanticProbe`) and a complete
answer offered for storage (:class:`SemanticAnswer`).

An entry stores the OpenAI response object a client received:
:meth:`SemanticAnswer.as_response` writes it, :meth:`SemanticHit.of_entry` reads it back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from billing.models import TenantId
from kvtoll.openai.responses import (
    ChoiceResult,
    ResponseMeta,
    chat_completion,
    text_completion,
    usage_dict,
)
from proxy.semantic.capacity import TenantCapacity

if TYPE_CHECKING:
    from proxy.semantic.store import CacheEntry


@dataclass(frozen=True)
class SemanticQuery:
    """One request as the semantic cache sees it (identity is server-derived)."""

    tenant_id: TenantId
    request_id: str  # server-generated; lets feedback name the entry that answered
    kind: Literal["chat", "completion"]
    model: str
    body: dict[str, Any]  # the validated client body, without any salt field
    threshold: float | None  # tenant policy (None = cache default)
    allow_sampled: bool  # tenant allows hits for temperature > 0 requests
    capacity: TenantCapacity | None = None  # tenant policy: its semantic-cache limits
    max_error_rate: float | None = None  # tenant policy: the error bound (None: no bound)
    tenant_name: str = ""  # for the figures shown per tenant (never part of a cache key)


@dataclass(frozen=True)
class SemanticChoice:
    text: str
    finish_reason: str


@dataclass(frozen=True)
class SemanticHit:
    """A stored answer judged equivalent to the query."""

    choices: tuple[SemanticChoice, ...]
    similarity: float
    completion_tokens: int  # of the stored answer (the gateway counts the new prompt)
    entry: CacheEntry | None = None  # the entry that answered (None: not from a store)
    score: float | None = None  # the verifier's score of the hit

    @staticmethod
    def of_entry(entry: CacheEntry, similarity: float, score: float | None = None) -> SemanticHit:
        """The hit an entry gives: its choices' text and finish reasons, its usage."""
        answer = entry.answer
        choices = tuple(
            SemanticChoice(text=_choice_text(c), finish_reason=str(c.get("finish_reason")))
            for c in answer.get("choices", [])
        )
        usage = answer.get("usage") or {}
        return SemanticHit(choices, float(similarity), int(usage.get("completion_tokens", 0)),
                           entry, score)


@dataclass(frozen=True)
class SemanticProbe:
    """A would-be hit answered from the engine so that the answers can be compared:
    ``explored`` (the error bound would have served it) or held back (it would not)."""

    entry_id: str
    score: float
    similarity: float
    stored_texts: tuple[str, ...]
    explored: bool
    exact_compare: bool  # a temperature-0 request: the answers must be equal


@dataclass(frozen=True)
class SemanticAnswer:
    """A complete upstream answer offered for storage (only ``stop`` answers are sent)."""

    choices: tuple[SemanticChoice, ...]
    prompt_tokens: int
    completion_tokens: int

    def as_response(self, kind: Literal["chat", "completion"], model: str) -> dict[str, Any]:
        """The OpenAI object a client received for this answer (what an entry stores)."""
        results = [ChoiceResult(index=i, text=c.text, finish_reason=c.finish_reason)
                   for i, c in enumerate(self.choices)]
        usage = usage_dict(self.prompt_tokens, self.completion_tokens, 0)
        build = chat_completion if kind == "chat" else text_completion
        return build(ResponseMeta.new(kind, model), results, usage)


def _choice_text(choice: Mapping[str, Any]) -> str:
    message = choice.get("message")
    if isinstance(message, Mapping):
        return str(message.get("content") or "")
    return str(choice.get("text") or "")


def is_complete(answer: Mapping[str, Any], allow_tool_calls: bool) -> bool:
    """Every choice finished with "stop" (or "tool_calls" when allowed)."""
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices:
        return False
    for choice in choices:
        if not isinstance(choice, Mapping):
            return False
        reason = choice.get("finish_reason")
        message = choice.get("message")
        has_tools = isinstance(message, Mapping) and bool(message.get("tool_calls"))
        if has_tools or reason == "tool_calls":
            if not allow_tool_calls or reason not in ("stop", "tool_calls"):
                return False
        elif reason != "stop":
            return False
    return True
