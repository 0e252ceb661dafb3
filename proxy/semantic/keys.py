"""Which requests may use the semantic cache, and under which exact-match partition.

A cached answer may only be reused when everything that shapes the answer, except
the wording of the last user turn, is identical. So a request maps to

* a **partition key**: SHA-256 over the tenant id, the model, every answer-changing
  parameter (temperature, top_p, max_tokens, tools, tool_choice, response_format,
  n, stop, seed, penalties, logprobs, ... — everything in the body except the
  fields in :data:`IGNORED_FIELDS`), the system prompt and every earlier turn;
* a **query text**: the last user turn, the only part that is embedded.

Requests are not cacheable when sampling is on (temperature > 0, and an absent
temperature means the OpenAI default of 1.0) unless the tenant opted in, when the
last message is not a plain-text user turn, or when there is nothing to embed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NewType

PartitionKey = NewType("PartitionKey", str)

OPENAI_DEFAULT_TEMPERATURE = 1.0
# Body fields that do not change the answer (transport, bookkeeping) or are the query.
IGNORED_FIELDS = frozenset(
    {"messages", "prompt", "model", "stream", "stream_options", "user", "metadata", "store"}
)


@dataclass(frozen=True)
class CacheKey:
    """Where a request is looked up: exact partition plus the text to embed."""

    tenant_id: str
    partition: PartitionKey
    query: str


@dataclass(frozen=True)
class NotCacheable:
    """Why a request bypasses the semantic cache."""

    reason: str


def build_cache_key(
    tenant_id: str | int,
    body: Mapping[str, Any],
    *,
    allow_sampled: bool = False,
    default_temperature: float = OPENAI_DEFAULT_TEMPERATURE,
) -> CacheKey | NotCacheable:
    """Partition and query text of a chat (``messages``) or completion (``prompt``) body."""
    temperature = body.get("temperature")
    temperature = default_temperature if temperature is None else temperature
    if not isinstance(temperature, int | float) or (temperature > 0 and not allow_sampled):
        return NotCacheable("sampling (temperature > 0) and the tenant has not opted in")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        return NotCacheable("no model")
    split = _split_turns(body)
    if isinstance(split, NotCacheable):
        return split
    context, query = split
    params = {k: v for k, v in body.items() if k not in IGNORED_FIELDS}
    params["temperature"] = temperature
    material = {"tenant": str(tenant_id), "model": model, "params": params, "context": context}
    digest = hashlib.sha256(_canonical(material).encode()).hexdigest()
    return CacheKey(tenant_id=str(tenant_id), partition=PartitionKey(digest), query=query)


def _split_turns(body: Mapping[str, Any]) -> tuple[list[Any], str] | NotCacheable:
    """(every turn before the last user turn, last user turn text)."""
    messages = body.get("messages")
    if messages is None:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            return NotCacheable("prompt is not a single non-empty string")
        return [], prompt
    if not isinstance(messages, list) or not messages:
        return NotCacheable("no messages")
    last = messages[-1]
    if not isinstance(last, Mapping) or last.get("role") != "user":
        return NotCacheable("last message is not a user turn")
    text = _plain_text(last.get("content"))
    if text is None or not text.strip():
        return NotCacheable("last user turn is not plain text")
    extra = {k: v for k, v in last.items() if k not in ("role", "content")}
    return [*messages[:-1], {"last_turn_fields": extra}], text


def _plain_text(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                return None
            text = part.get("text")
            if not isinstance(text, str):
                return None
            parts.append(text)
        return "\n".join(parts)
    return None


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
