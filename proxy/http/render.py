"""Upstream items → OpenAI response objects and SSE frames (via the shared builders);
a chat choice's tool calls pass through in OpenAI's shape (streamed: the deltas as
they came, ``content`` left out of a delta without text; whole: the message's
``tool_calls`` with ``content`` null when no text came)."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from kvtoll.openai.errors import SERVER_ERROR, OpenAIError, error_body
from kvtoll.openai.responses import (
    Kind,
    ResponseMeta,
    chat_chunk,
    chat_completion,
    text_chunk,
    text_completion,
    usage_chunk,
    usage_dict,
)
from kvtoll.openai.sse import SSE_DONE, sse_event
from proxy.tally import Tally
from proxy.upstream.base import UpstreamDelta, UpstreamError, UpstreamUsage

log = logging.getLogger(__name__)


def usage_of(usage: UpstreamUsage) -> dict[str, Any]:
    """OpenAI usage with ``prompt_tokens_details.cached_tokens`` (and kvtoll's
    ``kvtoll_tier_cached_tokens`` when the worker has a KV tier)."""
    cached = min(usage.cached_tokens, usage.prompt_tokens)
    return usage_dict(usage.prompt_tokens, usage.completion_tokens, cached,
                      usage.tier_cached_tokens)


def whole_response(kind: Kind, meta: ResponseMeta, tally: Tally) -> dict[str, Any]:
    """The non-streamed body once every item was folded into ``tally``."""
    if tally.usage is None:
        raise RuntimeError("a finished response must carry usage")
    build = chat_completion if kind == "chat" else text_completion
    body = build(meta, tally.choices(), usage_of(tally.usage))
    for choice in body["choices"]:
        choice["logprobs"] = tally.logprobs(choice["index"])
        if kind == "chat":
            tool_calls = tally.tool_calls(choice["index"])
            if tool_calls is not None:
                message = choice["message"]
                message["content"] = message["content"] or None
                message["tool_calls"] = tool_calls
    return body


def tool_call_delta(call: dict[str, Any], position: int) -> dict[str, Any]:
    """One upstream tool call in OpenAI's streamed delta shape: ``index`` (its position
    when the upstream gave none), ``id``, ``type`` and ``function`` {``name``,
    ``arguments``} when present, other fields dropped."""
    out: dict[str, Any] = {"index": int(call.get("index", position))}
    for name in ("id", "type"):
        if call.get(name) is not None:
            out[name] = str(call[name])
    function = call.get("function")
    if function is not None:
        out["function"] = {k: str(function[k]) for k in ("name", "arguments")
                           if function.get(k) is not None}
    return out


def _delta_frame(kind: Kind, meta: ResponseMeta, delta: UpstreamDelta, first: bool) -> bytes:
    if kind == "chat":
        chunk = chat_chunk(
            meta, delta.index, role="assistant" if first else None,
            content=delta.text or None if delta.tool_calls else delta.text,
            finish_reason=delta.finish_reason,
        )
        if delta.tool_calls:
            chunk["choices"][0]["delta"]["tool_calls"] = [
                tool_call_delta(call, position) for position, call in enumerate(delta.tool_calls)
            ]
    else:
        chunk = text_chunk(meta, delta.index, delta.text, delta.finish_reason)
    if delta.logprobs:
        chunk["choices"][0]["logprobs"] = delta.logprobs
    return sse_event(chunk)


async def sse_frames(
    kind: Kind, meta: ResponseMeta, items: AsyncGenerator[UpstreamDelta | UpstreamUsage, None],
    include_usage: bool,
) -> AsyncIterator[bytes]:
    """SSE frames for ``items``; an upstream failure mid-stream ends with an error event
    in OpenAI's shape, then ``[DONE]`` (so every client sees the stream end cleanly)."""
    started: set[int] = set()
    try:
        async for item in items:
            if isinstance(item, UpstreamUsage):
                if include_usage:
                    yield sse_event(usage_chunk(kind, meta, usage_of(item)))
                continue
            yield _delta_frame(kind, meta, item, item.index not in started)
            started.add(item.index)
        yield SSE_DONE
    except (UpstreamError, OpenAIError, OSError) as exc:
        log.warning("stream %s failed mid-way: %s", meta.id, exc)
        yield sse_event(
            error_body(f"upstream failed mid-stream: {exc}", type=SERVER_ERROR,
                       code="upstream_error")
        )
        yield SSE_DONE
    finally:
        await items.aclose()
