"""Builders for OpenAI response objects: ``chat.completion``, ``chat.completion.chunk``
and ``text_completion`` (whole and streamed), with the kvtoll usage object::

    {"prompt_tokens", "completion_tokens", "total_tokens",
     "prompt_tokens_details": {"cached_tokens"}}
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["chat", "completion"]


@dataclass(frozen=True)
class LogprobEntry:
    """One generated token with its logprob and the top alternatives (decoded)."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class ChoiceResult:
    """A finished choice of a non-streamed response."""

    index: int
    text: str
    finish_reason: str | None
    logprobs: tuple[LogprobEntry, ...] | None = None


@dataclass(frozen=True)
class ResponseMeta:
    """What every object of one response shares."""

    id: str
    model: str
    created: int

    @staticmethod
    def new(kind: Kind, model: str) -> ResponseMeta:
        """A fresh id (``chatcmpl-…`` / ``cmpl-…``) stamped now."""
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        return ResponseMeta(f"{prefix}-{uuid.uuid4().hex}", model, int(time.time()))


@dataclass(frozen=True)
class TierCachedTokens:
    """Of a prompt's cached tokens, those a KV tier loaded back (kvtoll's extension
    ``prompt_tokens_details.kvtoll_tier_cached_tokens``): ``host`` from the worker's
    own host tier, ``shared`` from the shared store (another worker computed them)."""

    host: int = 0
    shared: int = 0

    def __add__(self, other: TierCachedTokens) -> TierCachedTokens:
        return TierCachedTokens(self.host + other.host, self.shared + other.shared)

    def clamped(self, cached_tokens: int) -> TierCachedTokens:
        """Within ``cached_tokens`` (host first), never negative."""
        host = min(max(0, self.host), max(0, cached_tokens))
        return TierCachedTokens(host, min(max(0, self.shared), max(0, cached_tokens) - host))

    def as_json(self) -> dict[str, int]:
        return {"host": self.host, "shared": self.shared}

    @staticmethod
    def from_json(raw: object) -> TierCachedTokens | None:
        """The extension as an upstream sent it; None when absent or malformed."""
        if not isinstance(raw, dict):
            return None
        host, shared = raw.get("host", 0), raw.get("shared", 0)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (host, shared)):
            return None
        return TierCachedTokens(max(0, host), max(0, shared))


TIER_DETAILS_FIELD = "kvtoll_tier_cached_tokens"


def usage_dict(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    tier: TierCachedTokens | None = None,
) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens`` is a subset of ``prompt_tokens``, and
    ``tier`` (when the worker has a KV tier) the part of it a tier loaded."""
    details: dict[str, Any] = {"cached_tokens": cached_tokens}
    if tier is not None:
        details[TIER_DETAILS_FIELD] = tier.clamped(cached_tokens).as_json()
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": details,
    }


def _top_entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(entries: tuple[LogprobEntry, ...]) -> dict[str, Any]:
    """Chat-format logprobs: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    content = [
        {**_top_entry(e.token, e.logprob), "top_logprobs": [_top_entry(t, lp) for t, lp in e.top]}
        for e in entries
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(entries: tuple[LogprobEntry, ...], text_offset: int = 0) -> dict[str, Any]:
    """Completions-format logprobs: parallel ``tokens`` / ``token_logprobs`` lists."""
    offsets: list[int] = []
    for e in entries:
        offsets.append(text_offset)
        text_offset += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [dict(e.top) for e in entries],
        "text_offset": offsets,
    }


def chat_completion(
    meta: ResponseMeta, choices: list[ChoiceResult], usage: dict[str, Any]
) -> dict[str, Any]:
    """A whole ``chat.completion`` object."""
    return {
        "id": meta.id,
        "object": "chat.completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(c.logprobs) if c.logprobs is not None else None,
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ],
        "usage": usage,
    }


def text_completion(
    meta: ResponseMeta, choices: list[ChoiceResult], usage: dict[str, Any]
) -> dict[str, Any]:
    """A whole ``text_completion`` object."""
    return {
        "id": meta.id,
        "object": "text_completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [
            {
                "index": c.index,
                "text": c.text,
                "logprobs": completion_logprobs(c.logprobs) if c.logprobs is not None else None,
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ],
        "usage": usage,
    }


def chat_chunk(
    meta: ResponseMeta,
    index: int,
    *,
    role: str | None = None,
    content: str | None = None,
    finish_reason: str | None = None,
    logprobs: tuple[LogprobEntry, ...] | None = None,
) -> dict[str, Any]:
    """One ``chat.completion.chunk`` for choice ``index``."""
    delta: dict[str, Any] = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    return {
        "id": meta.id,
        "object": "chat.completion.chunk",
        "created": meta.created,
        "model": meta.model,
        "choices": [
            {
                "index": index,
                "delta": delta,
                "logprobs": chat_logprobs(logprobs) if logprobs else None,
                "finish_reason": finish_reason,
            }
        ],
    }


def text_chunk(
    meta: ResponseMeta,
    index: int,
    text: str,
    finish_reason: str | None = None,
    logprobs: tuple[LogprobEntry, ...] | None = None,
) -> dict[str, Any]:
    """One streamed ``text_completion`` object for choice ``index``."""
    return {
        "id": meta.id,
        "object": "text_completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [
            {
                "index": index,
                "text": text,
                "logprobs": completion_logprobs(logprobs) if logprobs else None,
                "finish_reason": finish_reason,
            }
        ],
    }


def usage_chunk(kind: Kind, meta: ResponseMeta, usage: dict[str, Any]) -> dict[str, Any]:
    """The last streamed object when ``include_usage``: no choices, the usage."""
    return {
        "id": meta.id,
        "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [],
        "usage": usage,
    }
