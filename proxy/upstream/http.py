"""An OpenAI-compatible server over HTTP as an :class:`~proxy.upstream.base.Upstream`:
kvtoll workers, vLLM, SGLang or anything speaking ``/v1/chat/completions``.

A streamed request (the client's ``stream: true``) goes upstream streamed, with
``stream_options.include_usage``, and is read back as server-sent events into
:class:`UpstreamDelta` items and one :class:`UpstreamUsage`. A request the client wants
whole (:attr:`UpstreamRequest.whole`) goes upstream with ``stream: false`` and comes back
as one JSON body: one delta per choice (its whole message), then the usage; neither side
pays per-event work, and the connection may stay silent for the whole generation, so its
read timeout is ``response_timeout_s`` instead of ``read_timeout_s``.
The server-derived tenant salt travels as ``cache_salt`` (hex), the field kvtoll
workers and vLLM read (``send_salt=False`` for servers that refuse unknown fields).

Status mapping (the caller's mistake vs the upstream's problem):

* 400, 413, 422 -> :class:`UpstreamRejected` (422 reported as 400): the body is wrong
  and another upstream would refuse it too;
* 401, 403, 404, 408, 429, 5xx, connection errors, timeouts, a malformed or cut
  stream -> :class:`UpstreamError`, ``retryable`` while nothing was yielded.

A server that ignores ``stream: true`` and answers one JSON object is read as such.
Tool calls (``delta.tool_calls``, or a whole message's ``tool_calls``) ride on the
deltas as sent, once checked (:func:`~proxy.upstream.reader.checked_tool_calls`).

kvtoll workers send the prompt's token count and its prefix-cached part as response
headers (``x-kvtoll-prompt-tokens``, ``x-kvtoll-cached-tokens``); they ride on the
first delta (:class:`UpstreamDelta` ``prompt_tokens``/``cached_tokens``).

Upstreams that send no usage: prompt tokens are the proxy's own count
(``prompt_token_ids``) or about 4 characters per token, completion tokens the number
of non-empty deltas; ``UpstreamUsage.extra["estimated"]`` says so.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from engine.api import KVShare
from kvtoll import fastjson
from kvtoll.openai.protocol import SALT_FIELDS
from proxy.upstream.base import (
    UpstreamDelta,
    UpstreamError,
    UpstreamRejected,
    UpstreamRequest,
    UpstreamUsage,
)
from proxy.upstream.h1 import H1Client, H1Error, H1Response, H1Timeout, Origin, request_head
from proxy.upstream.reader import ResponseReader, reported_cached_tokens, status_error
from proxy.upstream.sse_events import SseEvents
from proxy.upstream.usage_report import UsageReportWatch

_PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


@dataclass(frozen=True)
class HttpUpstreamConfig:
    """Where and how to reach one OpenAI-compatible server."""

    base_url: str  # http://host:port (a trailing /v1 is accepted)
    api_key: str | None = None  # sent as a bearer on every call (kvtoll workers: the worker token)
    model: str | None = None  # model name to send instead of the client's
    send_salt: bool = True
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 300.0  # longest silence between two bytes (streamed)
    response_timeout_s: float = 600.0  # longest wait for a whole (non-streamed) response
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

    answers_whole = True  # a whole request is asked whole (proxy.upstream.base.answers_whole)

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
        """The body sent upstream: the client's, streamed with usage (or, for a
        :attr:`~UpstreamRequest.whole` request, not streamed), with the proxy's salt
        (and model override)."""
        body = {k: v for k, v in request.body.items() if k not in SALT_FIELDS}
        if request.whole:
            body["stream"] = False
            body.pop("stream_options", None)  # servers refuse it without stream
        else:
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
        reader = ResponseReader(request)
        encoded = self._encoded(request)
        resp: H1Response | None = None
        try:
            resp = await self._client.send(
                self._origin, encoded, read_timeout_s=self.config.response_timeout_s
                if request.whole else self.config.read_timeout_s)
            if resp.status >= 400:
                raise status_error(resp.status, await resp.aread())
            reader.read_prompt_headers(resp.headers)
            if resp.headers.get("content-type", "").startswith("application/json"):
                for delta in reader.whole(fastjson.loads(await resp.aread())):
                    yield delta  # asked whole (or a server that ignored stream=true)
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
        body = fastjson.dumps({"shares": shares})
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


