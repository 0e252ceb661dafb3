"""An OpenAI-compatible server over HTTP as an :class:`~proxy.upstream.base.Upstream`:
kvtoll workers, vLLM, SGLang or anything speaking ``/v1/chat/completions``.

Every request goes upstream streamed (``stream: true`` with
``stream_options.include_usage``), whatever the client asked, and is read back as
server-sent events into :class:`UpstreamDelta` items and one :class:`UpstreamUsage`.
The server-derived tenant salt travels as ``cache_salt`` (hex), the field kvtoll
workers and vLLM read (``send_salt=False`` for servers that refuse unknown fields).

Status mapping (the caller's mistake vs the upstream's problem):

* 400, 413, 422 -> :class:`UpstreamRejected` (422 reported as 400): the body is wrong
  and another upstream would refuse it too;
* 401, 403, 404, 408, 429, 5xx, connection errors, timeouts, a malformed or cut
  stream -> :class:`UpstreamError`, ``retryable`` while nothing was yielded.

A server that ignores ``stream: true`` and answers one JSON object is read as such.
Tool calls (``delta.tool_calls``, or a whole message's ``tool_calls``) ride on the
deltas as sent, once checked (:func:`checked_tool_calls`).

kvtoll workers send the prompt's token count and its prefix-cached part as response
headers (``x-kvtoll-prompt-tokens``, ``x-kvtoll-cached-tokens``); they ride on the
first delta (:class:`UpstreamDelta` ``prompt_tokens``/``cached_tokens``).

Upstreams that send no usage: prompt tokens are the proxy's own count
(``prompt_token_ids``) or about 4 characters per token, completion tokens the number
of non-empty deltas; ``UpstreamUsage.extra["estimated"]`` says so.
"""

from __future__ import annotations

import json
import math
import ssl
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from engine.api import KVShare
from kvtoll import fastjson
from kvtoll.openai.protocol import SALT_FIELDS
from kvtoll.openai.responses import TIER_DETAILS_FIELD, TierCachedTokens
from kvtoll.openai.sse import (
    CACHED_TOKENS_HEADER,
    DONE_SENTINEL,
    PROMPT_TOKENS_HEADER,
)
from proxy.upstream.base import (
    UpstreamDelta,
    UpstreamError,
    UpstreamRejected,
    UpstreamRequest,
    UpstreamUsage,
)
from proxy.upstream.h1 import H1Client, H1Error, H1Response, H1Timeout, Origin, request_head
from proxy.upstream.sse_events import SseEvents
from proxy.upstream.usage_report import UsageReportWatch

_REJECTED = {400: 400, 413: 413, 422: 400}
_DONE = DONE_SENTINEL.encode()
_PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
CHARS_PER_TOKEN = 4


@dataclass(frozen=True)
class HttpUpstreamConfig:
    """Where and how to reach one OpenAI-compatible server."""

    base_url: str  # http://host:port (a trailing /v1 is accepted)
    api_key: str | None = None  # sent as a bearer on every call (kvtoll workers: the worker token)
    model: str | None = None  # model name to send instead of the client's
    send_salt: bool = True
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 300.0  # longest silence between two bytes
    max_connections: int = 256
    name: str | None = None  # what ``x-kvtoll-worker`` shows; default: the root URL
    ssl_context: ssl.SSLContext | None = None  # https: trust this (default: system CAs)

    def root(self) -> str:
        """``base_url`` without a trailing ``/`` or ``/v1``."""
        url = self.base_url.rstrip("/")
        return url.removesuffix("/v1")


def make_client(config: HttpUpstreamConfig) -> H1Client:
    """A connection pool with ``config``'s timeouts and size (may serve many origins)."""
    return H1Client(connect_timeout_s=config.connect_timeout_s,
                    read_timeout_s=config.read_timeout_s, max_connections=config.max_connections,
                    ssl_context=config.ssl_context)


def kv_share_field(share: KVShare) -> dict[str, Any]:
    """``kvtoll_kv_share`` as a kvtoll worker reads it (:class:`KVShareField`)."""
    return {"tenant": share.tenant, "reserved_blocks": share.reserved_blocks,
            "max_blocks": share.max_blocks}


class HttpUpstream:
    """One OpenAI-compatible server reached through a pooled :class:`H1Client`."""

    def __init__(self, config: HttpUpstreamConfig, client: H1Client | None = None) -> None:
        self.config = config
        self._root = config.root()
        self._origin = Origin.parse(self._root)
        self._owns_client = client is None
        self._client = client or make_client(config)
        self._auth_headers = {"authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self._static_headers = {"accept": "text/event-stream", "content-type": "application/json",
                                **self._auth_headers}
        self._usage_report = UsageReportWatch(self.name)
        # each path's request head up to the per-request headers, encoded once
        self._heads = {kind: request_head("POST", self._origin, path, self._static_headers)
                       for kind, path in _PATHS.items()}

    @property
    def name(self) -> str:
        return self.config.name or self._root

    def request_body(self, request: UpstreamRequest) -> dict[str, Any]:
        """The body sent upstream: the client's, forced to stream with usage, with
        the proxy's salt (and model override)."""
        body = {k: v for k, v in request.body.items() if k not in SALT_FIELDS}
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        if self.config.model is not None:
            body["model"] = self.config.model
        if self.config.send_salt:
            body["cache_salt"] = request.salt.hex()
            if request.kv_share is not None:
                body["kvtoll_kv_share"] = kv_share_field(request.kv_share)
        return body

    def _encoded(self, request: UpstreamRequest) -> bytes:
        """The whole HTTP request for ``request``: its path's head, ``x-request-id``,
        ``content-length``, the JSON body."""
        body = fastjson.dumps(self.request_body(request))
        return b"%bx-request-id: %b\r\ncontent-length: %d\r\n\r\n%b" % (
            self._heads[request.kind], request.request_id.encode("latin-1"), len(body), body)

    async def stream(
        self, request: UpstreamRequest
    ) -> AsyncGenerator[UpstreamDelta | UpstreamUsage, None]:
        """Deltas then one usage item (see :class:`~proxy.upstream.base.Upstream`)."""
        reader = _StreamReader(request)
        encoded = self._encoded(request)
        resp: H1Response | None = None
        try:
            resp = await self._client.send(self._origin, encoded,
                                           read_timeout_s=self.config.read_timeout_s)
            if resp.status >= 400:
                raise _status_error(resp.status, await resp.aread())
            reader.read_prompt_headers(resp.headers)
            if resp.headers.get("content-type", "").startswith("application/json"):
                for delta in reader.whole(fastjson.loads(await resp.aread())):
                    yield delta  # a server that ignored stream=true
            else:
                events = SseEvents()
                async for chunk in resp.aiter_bytes():
                    for data in events.feed(chunk):
                        for delta in reader.feed(data):
                            yield delta
                for data in events.close():
                    for delta in reader.feed(data):
                        yield delta
        except H1Timeout as exc:
            raise reader.error(f"{self.name} timed out ({exc})", 504) from None
        except (H1Error, OSError) as exc:
            raise reader.error(f"{self.name} unreachable: {exc!r}", 502) from None
        except (UpstreamRejected, UpstreamError):
            raise
        except (ValueError, TypeError, AttributeError, KeyError) as exc:
            # Bad JSON or wrongly typed fields from the upstream: its fault, not the
            # caller's, and handled like any other upstream failure (retry, ledger row).
            raise reader.error(f"{self.name} sent a malformed response: {exc!r}", 502) from None
        finally:
            if resp is not None:
                await resp.aclose()
        try:
            usage = reader.finish()
        except (ValueError, TypeError, AttributeError) as exc:
            raise reader.error(f"{self.name} sent malformed usage: {exc!r}", 502) from None
        self._usage_report.observe(reported_cached_tokens(usage))
        yield usage

    def usage_problem(self) -> str | None:
        """Why this upstream's cached tokens cannot be billed (:mod:`.usage_report`)."""
        return self._usage_report.problem()

    async def health(self) -> bool:
        """``GET /healthz`` (kvtoll workers, vLLM), else ``GET /v1/models``."""
        for path in ("/healthz", "/v1/models"):
            try:
                resp = await self._client.request(
                    "GET", self._origin, path, self._auth_headers,
                    read_timeout_s=self.config.connect_timeout_s,
                )
                await resp.aread()
            except (H1Error, OSError):
                return False
            if resp.status == 200:
                return True
            if resp.status != 404:
                return False
        return False

    async def push_kv_shares(self, shares: list[dict[str, Any]]) -> bool | None:
        """``PUT /kv/shares`` (:mod:`proxy.kv_policy_push`): True if accepted, False if
        it failed, None if this upstream takes no shares (not a kvtoll worker)."""
        if not self.config.send_salt:
            return None
        body = json.dumps({"shares": shares}).encode()
        headers = {"content-type": "application/json", **self._auth_headers}
        try:
            resp = await self._client.request("PUT", self._origin, "/kv/shares", headers, body,
                                              read_timeout_s=self.config.connect_timeout_s)
            await resp.aread()
        except (H1Error, OSError):
            return False
        return None if resp.status in (404, 405, 501) else resp.status == 200

    async def aclose(self) -> None:
        """Close the connection pool (when this upstream created it)."""
        if self._owns_client:
            await self._client.aclose()


class _StreamReader:
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
        self.done = True
        choices = [
            {**c, "delta": c.get("message") or {}} if isinstance(c, dict) else {}
            for c in body["choices"]
        ]
        deltas = [d for d in map(self._delta, choices) if d is not None]
        self.produced = bool(deltas)
        return deltas

    def _delta(self, choice: dict[str, Any]) -> UpstreamDelta | None:
        index = int(choice.get("index", 0))
        tool_calls = None
        if self.kind == "chat":
            delta = choice.get("delta") or {}
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
        delta = UpstreamDelta(index, text, reason, logprobs, tool_calls)
        if self.counts is not None:
            delta = replace(delta, prompt_tokens=self.counts[0], cached_tokens=self.counts[1])
            self.counts = None
        return delta

    def finish(self) -> UpstreamUsage:
        """The usage item; an error if the stream stopped before its end."""
        if not self.done and not self.finished:
            raise self.error("upstream stream ended before completion")
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


def _status_error(code: int, raw: bytes) -> UpstreamRejected | UpstreamError:
    try:
        body: object = json.loads(raw)
    except ValueError:
        body = raw.decode("utf-8", errors="replace")
    message = _error_message(body)
    if code in _REJECTED:
        return UpstreamRejected(message, status=_REJECTED[code], param=_error_param(body))
    status = 504 if code == 408 else 502
    return UpstreamError(f"upstream answered {code}: {message}", status=status)
