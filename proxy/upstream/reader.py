"""Reading one upstream response: server-sent ``data`` payloads (or one whole JSON
body) into :class:`UpstreamDelta` items and the final :class:`UpstreamUsage`, and an
error status into :class:`UpstreamRejected` / :class:`UpstreamError` (the status
mapping and the usage estimate for servers that send none are described in
:mod:`proxy.upstream.http`)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from kvtoll import fastjson
from kvtoll.openai.responses import TIER_DETAILS_FIELD, TierCachedTokens
from kvtoll.openai.sse import CACHED_TOKENS_HEADER, DONE_SENTINEL, PROMPT_TOKENS_HEADER
from proxy.upstream.base import (
    UpstreamDelta,
    UpstreamError,
    UpstreamRejected,
    UpstreamRequest,
    UpstreamUsage,
)

_REJECTED = {400: 400, 413: 413, 422: 400}
_DONE = DONE_SENTINEL.encode()
CHARS_PER_TOKEN = 4


class ResponseReader:
    """Turns SSE ``data`` payloads of one response into deltas and the final usage."""

    def __init__(self, request: UpstreamRequest) -> None:
        self.request = request
        self.kind = request.kind
        self.produced = False
        self.done = False
        self.usage: dict[str, Any] | None = None
        self.finished: set[int] = set()
        self.num_deltas = 0
        self.counts: tuple[int, int] | None = None  # (prompt, cached) for the first delta
        self.whole_usage: UpstreamUsage | None = None  # a whole body's usage, read once

    def read_prompt_headers(self, headers: Mapping[str, str]) -> None:
        """A kvtoll worker's prompt counts (see ``kvtoll.openai.sse``), for the first
        delta; other servers send none."""
        prompt_header = headers.get(PROMPT_TOKENS_HEADER)
        cached_header = headers.get(CACHED_TOKENS_HEADER)
        if prompt_header is None or cached_header is None:
            return  # the usual case for other servers: no exception raised and caught
        try:
            prompt, cached = int(prompt_header), int(cached_header)
        except ValueError:
            return
        if 0 <= cached <= prompt:
            self.counts = (prompt, cached)

    def error(self, message: str, status: int = 502) -> UpstreamError:
        return UpstreamError(message, status=status, retryable=not self.produced)

    def feed(self, data: bytes) -> list[UpstreamDelta]:
        """The deltas of one event's ``data`` (UTF-8; a malformed sequence is read as
        U+FFFD, as a text decoder with ``errors="replace"`` would)."""
        if self.done:
            return []  # after [DONE]: the rest is read (to reuse the connection), not used
        if data == _DONE:
            self.done = True
            return []
        try:
            event = fastjson.fast_loads(data)
        except ValueError:  # orjson refused it: json decides, on the replaced text
            text = data.decode("utf-8", errors="replace")
            try:
                event = json.loads(text)
            except json.JSONDecodeError:
                raise self.error(f"malformed event from upstream: {text[:200]!r}") from None
        if not isinstance(event, dict):
            raise self.error(f"malformed event from upstream: {data[:200]!r}")
        if "error" in event:
            raise self.error(f"upstream error mid-stream: {_error_message(event)}")
        if isinstance(event.get("usage"), dict):
            self.usage = event["usage"]
        deltas = [d for d in map(self._delta, event.get("choices") or []) if d is not None]
        self.produced = self.produced or bool(deltas)
        return deltas

    def whole(self, body: object) -> list[UpstreamDelta]:
        """A non-streamed response body: one delta per choice."""
        if not isinstance(body, dict) or not isinstance(body.get("choices"), list):
            raise self.error(f"malformed response from upstream: {str(body)[:200]!r}")
        if isinstance(body.get("usage"), dict):
            self.usage = body["usage"]
            self._read_whole_usage(self.usage)
        self.done = True
        deltas = [d for d in (self._delta(c if isinstance(c, dict) else {}, "message")
                              for c in body["choices"]) if d is not None]
        self.produced = bool(deltas)
        return deltas

    def _read_whole_usage(self, usage: dict[str, Any]) -> None:
        """A whole body's usage, for :meth:`finish`; its prompt counts go on the first
        delta, as a worker's headers would (when it reports cached tokens)."""
        try:
            self.whole_usage = _reported_usage(usage)
        except (ValueError, TypeError, AttributeError):
            return  # finish() reports the malformed usage
        if self.counts is None and "cached_tokens_reported" not in self.whole_usage.extra:
            self.counts = (self.whole_usage.prompt_tokens, self.whole_usage.cached_tokens)

    def _delta(self, choice: dict[str, Any], field: str = "delta") -> UpstreamDelta | None:
        """One choice's delta (``field``: ``message`` in a whole body)."""
        index = int(choice.get("index", 0))
        tool_calls = None
        if self.kind == "chat":
            delta = choice.get(field) or {}
            text = delta.get("content") or ""
            if delta.get("tool_calls"):
                tool_calls = checked_tool_calls(delta["tool_calls"])
        else:
            text = choice.get("text") or ""
        reason, logprobs = choice.get("finish_reason"), choice.get("logprobs")
        if reason is not None:
            self.finished.add(index)
        if not (text or reason or tool_calls or logprobs):
            return None
        self.num_deltas += bool(text or tool_calls)
        if self.counts is None:
            return UpstreamDelta(index, text, reason, logprobs, tool_calls)
        (prompt, cached), self.counts = self.counts, None
        return UpstreamDelta(index, text, reason, logprobs, tool_calls, prompt, cached)

    def finish(self) -> UpstreamUsage:
        """The usage item; an error if the stream stopped before its end."""
        if not self.done and not self.finished:
            raise self.error("upstream stream ended before completion")
        if self.whole_usage is not None:
            return self.whole_usage
        if self.usage is not None:
            return _reported_usage(self.usage)
        return self._estimated_usage()

    def _estimated_usage(self) -> UpstreamUsage:
        ids = self.request.prompt_token_ids
        if ids is not None:
            prompt, method = len(ids), "proxy tokenizer"
        else:
            prompt, method = _approx_prompt_tokens(self.request.body), "chars/4"
        extra = {"estimated": True, "prompt_method": method, "completion_method": "delta count"}
        return UpstreamUsage(prompt, self.num_deltas, 0, extra)


def checked_tool_calls(raw: object) -> list[dict[str, Any]]:
    """An upstream's ``tool_calls`` (streamed deltas, or a whole message's list), as
    sent, once they are a list of objects whose ``function`` (if any) is an object
    (``TypeError`` otherwise: a malformed response). Rendering shapes them."""
    if not isinstance(raw, list):
        raise TypeError(f"tool_calls must be a list, got {type(raw).__name__}")
    for entry in raw:
        if not isinstance(entry, dict):
            raise TypeError(f"a tool call must be an object, got {type(entry).__name__}")
        if not isinstance(entry.get("function", {}), dict):
            raise TypeError("a tool call's function must be an object")
    return raw


def reported_cached_tokens(usage: UpstreamUsage) -> bool:
    """Whether the upstream's usage said how many prompt tokens were cached."""
    return not usage.extra.get("estimated") and usage.extra.get("cached_tokens_reported", True)


def _reported_usage(usage: dict[str, Any]) -> UpstreamUsage:
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    extra = {} if cached is not None else {"cached_tokens_reported": False}
    prompt = max(0, int(usage.get("prompt_tokens") or 0))
    completion = max(0, int(usage.get("completion_tokens") or 0))
    # Clamped so a misreporting upstream cannot produce a ledger entry that must be refused.
    cached_n = min(prompt, max(0, int(cached or 0)))
    tier = TierCachedTokens.from_json(details.get(TIER_DETAILS_FIELD)) if isinstance(
        details, dict) else None
    return UpstreamUsage(prompt, completion, cached_n, extra,
                         None if tier is None else tier.clamped(cached_n))


def _approx_prompt_tokens(body: dict[str, Any]) -> int:
    texts: list[str] = []
    num_ids = 0
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts.extend(str(p.get("text", "")) for p in content if isinstance(p, dict))
    prompt = body.get("prompt")
    items = [prompt] if isinstance(prompt, str) else prompt if isinstance(prompt, list) else []
    for item in items:
        if isinstance(item, str):
            texts.append(item)
        elif isinstance(item, int):
            num_ids += 1
        elif isinstance(item, list):
            num_ids += len(item)
    return max(1, num_ids + math.ceil(sum(map(len, texts)) / CHARS_PER_TOKEN))


def _error_message(body: object) -> str:
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        for key in ("message", "detail", "error"):
            if isinstance(body.get(key), str):
                return str(body[key])
    return str(body)[:500]


def _error_param(body: object) -> str | None:
    err = body.get("error") if isinstance(body, dict) else None
    param = err.get("param") if isinstance(err, dict) else None
    return param if isinstance(param, str) else None


def status_error(code: int, raw: bytes) -> UpstreamRejected | UpstreamError:
    try:
        body: object = json.loads(raw)
    except ValueError:
        body = raw.decode("utf-8", errors="replace")
    message = _error_message(body)
    if code in _REJECTED:
        return UpstreamRejected(message, status=_REJECTED[code], param=_error_param(body))
    status = 504 if code == 408 else 502
    return UpstreamError(f"upstream answered {code}: {message}", status=status)
