"""The completion endpoints as raw ASGI routes, mounted once, in the gateway's app.

``POST /v1/chat/completions`` and ``POST /v1/completions`` are the gateway's hot path.
A FastAPI route would build a ``Request`` object, resolve dependencies and render
through a response class before and after the service call (~0.3 ms of CPU per
request, measured); the endpoints use none of it, so each path is mounted once, as a
plain Starlette ``Route`` whose endpoint is an ASGI callable (:class:`CompletionRoute`),
by :meth:`GatewayApp.mount_completions`. Being the app's one mounting of these paths,
they sit behind the app's middleware, a wrong method is a 405, a ``root_path`` is
honoured, and ``/openapi.json`` documents them.

FastAPI's own layers around every request (error and telemetry middleware, the route
scan) cost ~15-35 µs per request, measured, and uvicorn's request cycle more; the
endpoints answer their own errors, so while the app has no middleware of its own the
completion routes are its direct routes (:meth:`GatewayApp.direct_route`): under
``kvtoll serve`` the server hands a POST to their path straight to the route, without
uvicorn's ASGI cycle (:mod:`kvtoll.direct_http`), and under any other ASGI server
:class:`GatewayApp` calls the route first thing. Anything else, and everything once
middleware is added, goes through the stack to the same routes::

    server ─► direct route (kvtoll serve) ─────────────────────────────► CompletionRoute
      │ otherwise                                                         auth → intake →
      ▼                                                                   gateway → JSON
    GatewayApp ──POST to a completion path, no app middleware──────────► or SSE over ASGI
      │ otherwise
      ▼
    middleware ─► router ─► CompletionRoute, FastAPI routes (models, dashboards, admin),
                            404 / 405

Behaviour: OpenAI error objects for every refusal (401, 400, 404, 413, 429 with
``Retry-After``, 502/503/504 with ``Retry-After``, and, once the request has an id,
``x-request-id`` and ``x-kvtoll-request-id``; a request that failed unserved is
refunded to the key's rate limit), a 500 in the same shape for an unexpected failure,
``x-kvtoll-*`` headers, SSE with the same headers, and a streamed response is
cancelled as soon as the client disconnects (so its ledger row says
``client_disconnect``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, FastAPI
from pydantic import BaseModel
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from kvtoll import fastjson
from kvtoll.openai.errors import (
    SERVER_ERROR,
    OpenAIError,
    body_too_large,
    check_declared_length,
)
from kvtoll.openai.responses import ResponseMeta
from kvtoll.openai.sse import SSE_HEADERS
from proxy.budget import ALERT_HEADER, BudgetExceeded
from proxy.http.render import sse_frames, whole_response
from proxy.intake import Intake, Kind, Prepared, RateLimited
from proxy.reply import Reply
from proxy.service import Gateway
from proxy.upstream.base import UpstreamError

log = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
# path -> (intake kind, metrics endpoint label)
ROUTES: dict[str, tuple[Kind, str]] = {
    CHAT_PATH: ("chat", "chat"),
    COMPLETIONS_PATH: ("completion", "completions"),
}
_JSON = (b"content-type", b"application/json")
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8")] + [
    (name.lower().encode("latin-1"), value.encode("latin-1"))
    for name, value in SSE_HEADERS.items()
]


class _ClientGone(Exception):
    """The client disconnected before its request body arrived."""


def response_meta(kind: Kind, request_id: str, model: str) -> ResponseMeta:
    """The response's id (``chatcmpl-…`` / ``cmpl-…``) is the request id's hex: unique
    like it, one random UUID per request instead of two."""
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    return ResponseMeta(f"{prefix}-{request_id.replace('-', '')}", model, int(time.time()))


def json_bytes(content: Any) -> bytes:
    """JSON as Starlette's ``JSONResponse`` renders it (compact, UTF-8), through
    :func:`kvtoll.fastjson.dumps` (a non-finite float from an upstream is ``null``)."""
    return fastjson.dumps(content)


def reply_headers(reply: Reply) -> list[tuple[bytes, bytes]]:
    """``x-kvtoll-request-id``, ``-cache`` and, when known, ``-worker``, ``-similarity``."""
    headers = [(b"x-kvtoll-request-id", reply.request_id.encode("latin-1")),
               (b"x-kvtoll-cache", reply.cache_header().encode("latin-1"))]
    if reply.worker:
        headers.append((b"x-kvtoll-worker", reply.worker.encode("latin-1")))
    if reply.similarity is not None:
        headers.append((b"x-kvtoll-similarity", f"{reply.similarity:.4f}".encode("latin-1")))
    if reply.budget_alert is not None:
        headers.append((ALERT_HEADER.encode("latin-1"), reply.budget_alert.encode("latin-1")))
    return headers


async def send_json(send: Send, status: int, content: Any,
                    headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """One whole JSON response."""
    body = json_bytes(content)
    raw = [(b"content-length", str(len(body)).encode("latin-1")), _JSON, *(headers or ())]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": False})


RETRY_AFTER_UNAVAILABLE_S = 1  # Retry-After of a 502/503/504: a dependency failed


def _error_headers(exc: OpenAIError, request_id: str | None) -> list[tuple[bytes, bytes]]:
    headers: list[tuple[bytes, bytes]] = []
    if request_id is not None:
        rid = request_id.encode("latin-1")
        headers += [(b"x-request-id", rid), (b"x-kvtoll-request-id", rid)]
    if isinstance(exc, RateLimited):
        headers.append((b"retry-after", str(exc.retry_after_s).encode("latin-1")))
    elif isinstance(exc, BudgetExceeded):  # retrying cannot help (OpenAI's SDKs read this)
        headers.append((b"x-should-retry", b"false"))
    elif exc.status in (502, 503, 504):
        headers.append((b"retry-after", str(RETRY_AFTER_UNAVAILABLE_S).encode("latin-1")))
    return headers


async def read_body(receive: Receive, declared: str | None, max_bytes: int) -> bytes:
    """The request body, refusing (413) more than ``max_bytes`` before reading it all
    (the rules of ``kvtoll.openai.errors.read_body_bytes``, on raw ASGI)."""
    check_declared_length(declared, max_bytes)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise _ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise body_too_large(max_bytes)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class CompletionEndpoints:
    """Serves the completion paths of :data:`ROUTES` (see module doc)."""

    def __init__(self, intake: Intake, gateway: Gateway) -> None:
        self._intake = intake
        self._gateway = gateway

    async def handle(self, path: str, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer one request for ``path`` (a key of :data:`ROUTES`)."""
        kind, endpoint = ROUTES[path]
        started = False
        request_id: list[str] = []  # set once intake gave the request its id

        async def send_tracked(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await self._complete(kind, endpoint, scope, receive, send_tracked, request_id)
        except OpenAIError as exc:
            if started:
                raise
            await send_json(send, exc.status, exc.body(),
                            _error_headers(exc, request_id[0] if request_id else None))
        except _ClientGone:
            return
        except Exception:
            if started:
                raise
            log.exception("completion request failed")
            error = OpenAIError("The server had an error while processing your request",
                                status=500, type=SERVER_ERROR, code="internal_error")
            await send_json(send, 500, error.body())

    async def _complete(self, kind: Kind, endpoint: str, scope: Scope, receive: Receive,
                        send: Send, request_id: list[str]) -> None:
        authorization = cache_control = declared = None
        for name, value in scope["headers"]:
            if name == b"authorization" and authorization is None:
                authorization = value.decode("latin-1")
            elif name == b"cache-control" and cache_control is None:
                cache_control = value.decode("latin-1")
            elif name == b"content-length" and declared is None:
                declared = value.decode("latin-1")
        identity = await self._intake.authenticate(authorization)

        async def body(max_bytes: int) -> bytes:
            return await read_body(receive, declared, max_bytes)

        prep = await self._intake.prepare(kind, identity, body, cache_control)
        request_id.append(prep.request_id)
        try:
            reply = await self._gateway.open(prep, endpoint)
            try:
                await self._respond(kind, prep, reply, receive, send)
            finally:
                await reply.aclose()  # a reply never read still gets its ledger row
        except OpenAIError as exc:
            if exc.status >= 500:  # nothing was served: not counted against the key
                await self._intake.refund(prep)
            raise

    async def _respond(self, kind: Kind, prep: Prepared, reply: Reply, receive: Receive,
                       send: Send) -> None:
        meta = response_meta(kind, prep.request_id, prep.model)
        if prep.request.stream:
            frames = sse_frames(kind, meta, reply.items, prep.request.include_usage())
            await stream_until_disconnect(
                frames, [*_SSE_HEADERS, *reply_headers(reply)], receive, send
            )
            return
        try:
            async for _ in reply.items:
                pass
        except UpstreamError as exc:
            raise OpenAIError(f"upstream failed: {exc}", status=502, type=SERVER_ERROR,
                              code="upstream_error") from exc
        await send_json(send, 200, whole_response(kind, meta, reply.tally),
                        reply_headers(reply))


async def stream_until_disconnect(frames: AsyncIterator[bytes],
                                  headers: list[tuple[bytes, bytes]], receive: Receive,
                                  send: Send) -> None:
    """Send ``frames`` as a 200 response body; stop (closing ``frames``) as soon as the
    client disconnects, which the server reports through ``receive``."""
    pump = asyncio.ensure_future(_pump(frames, headers, send))
    watch = asyncio.ensure_future(_until_disconnect(receive))
    try:
        await asyncio.wait((pump, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        pump.cancel()  # no-op when it finished
        await asyncio.wait((pump, watch))
        closer = getattr(frames, "aclose", None)
        if closer is not None:
            await closer()
    if not pump.cancelled():
        pump.result()  # a failure while sending


async def _pump(frames: AsyncIterator[bytes], headers: list[tuple[bytes, bytes]],
                send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    async for frame in frames:
        await send({"type": "http.response.body", "body": frame, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class CompletionRoute:
    """One completion path as an ASGI endpoint (Starlette calls it as it is)."""

    def __init__(self, endpoints: CompletionEndpoints, path: str) -> None:
        self._endpoints = endpoints
        self._path = path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._endpoints.handle(self._path, scope, receive, send)


class GatewayApp(FastAPI):
    """FastAPI with the completion routes (see module doc)."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._completion_routes: dict[str, CompletionRoute] = {}
        self._direct_routes: dict[bytes, CompletionRoute] = {}

    def mount_completions(self, endpoints: CompletionEndpoints) -> None:
        """Mount the completion paths, POST only, served by ``endpoints``."""
        router = APIRouter()
        for path in ROUTES:
            route = self._completion_routes[path] = CompletionRoute(endpoints, path)
            self._direct_routes[path.encode("ascii")] = route
            router.routes.append(Route(path, route, methods=["POST"], include_in_schema=False))
        self.include_router(router)

    def direct_route(self, method: bytes, raw_path: bytes) -> CompletionRoute | None:
        """The completion route for a POST to its path while the app has no middleware
        of its own and no ``root_path`` (:class:`kvtoll.direct_http.DirectRoutes`)."""
        if method != b"POST" or self.user_middleware or self.root_path:
            return None
        return self._direct_routes.get(raw_path)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and scope["method"] == "POST" and not self.user_middleware
                and not scope.get("root_path") and not self.root_path):
            route = self._completion_routes.get(scope["path"])
            if route is not None:
                await route(scope, receive, send)
                return
        await super().__call__(scope, receive, send)

    def openapi(self) -> dict[str, Any]:
        """FastAPI's schema plus the completion paths (:func:`completion_openapi`)."""
        if self.openapi_schema is None:
            completion_openapi(super().openapi())
        return super().openapi()


def completion_openapi(schema: dict[str, Any]) -> None:
    """Add the completion paths (raw ASGI routes, unseen by FastAPI's generator) to
    an OpenAPI ``schema``, with their request bodies from the shared serving models."""
    from kvtoll.openai.protocol import ChatCompletionRequest, CompletionRequest

    components = schema.setdefault("components", {}).setdefault("schemas", {})
    models: dict[str, type[BaseModel]] = {
        CHAT_PATH: ChatCompletionRequest, COMPLETIONS_PATH: CompletionRequest,
    }
    for path, model in models.items():
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body
        kind = ROUTES[path][0]
        schema.setdefault("paths", {})[path] = {"post": {
            "summary": f"OpenAI {'chat completions' if kind == 'chat' else 'legacy completions'}",
            "description": ("Bearer key required. With `\"stream\": true` the answer is "
                            "server-sent events (`text/event-stream`)."),
            "operationId": f"create_{kind}_completion",
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}},
            "responses": {
                "200": {"description": "The completion (JSON) or its event stream"},
                "default": {"description": "An OpenAI error object"},
            },
        }}
