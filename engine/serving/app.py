"""The engine worker's HTTP server (``kvtoll worker``): OpenAI chat and completions
(streamed or whole, usage with ``prompt_tokens_details.cached_tokens`` and, with a KV
tier, ``prompt_tokens_details.kvtoll_tier_cached_tokens``) plus what the proxy's prefix
router reads: ``GET /kv/events`` and ``GET /load`` (with each tenant's share of the
prefix cache), and ``GET /metrics`` (:mod:`engine.serving.metrics`); ``PUT /kv/shares``
takes the gateway's table of tenant shares (:mod:`engine.serving.shares`), so a
reservation holds before the tenant's next request.

Workers are internal services: only the kvtoll proxy should reach them, and with a
worker token configured (``WorkerConfig.tokens``) every request without it is
refused 401 before routing (:mod:`engine.serving.auth`). The tenant salt for
prefix caching is taken from ``cache_salt`` (hex), which the proxy derives
server-side and sets on every request, so it is only read from an authenticated
gateway; a worker never derives or guesses a salt from anything else. Bad input is
a 4xx in OpenAI's shape and the worker keeps serving; a client that goes away aborts
its engine request.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.api import AsyncEngineClient, EngineRejected, KVShare
from engine.api.convert import PreparedRequest, prepare, rejection_error
from engine.api.generation import ChoiceDelta, UsageTotals, collect, run_prepared
from engine.kv.hashing import TenantSalt
from engine.serving.auth import WorkerAuth
from engine.serving.metrics import CONTENT_TYPE, WorkerMetrics
from engine.serving.shares import apply_shares
from kvtoll.openai.errors import (
    DEFAULT_MAX_BODY_BYTES,
    SERVER_ERROR,
    OpenAIError,
    error_body,
    install_error_handlers,
    read_json_body,
)
from kvtoll.openai.protocol import OpenAIRequest, parse_request
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
from kvtoll.openai.sse import (
    CACHED_TOKENS_HEADER,
    PROMPT_TOKENS_HEADER,
    SSE_DONE,
    SSE_HEADERS,
    SSE_MEDIA_TYPE,
    sse_event,
)
from kvtoll.worker_auth import WorkerTokens

log = logging.getLogger(__name__)
T = TypeVar("T")
CLIENT_CLOSED_REQUEST = 499
_Stream = AsyncGenerator[ChoiceDelta | UsageTotals, None]


@dataclass(frozen=True)
class WorkerConfig:
    """Worker server options. ``served_model_names`` empty: the engine's model name;
    ``tokens`` empty: no caller authentication (dev mode only, see ``kvtoll worker``)."""

    served_model_names: tuple[str, ...] = ()
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    tokens: WorkerTokens = field(default_factory=WorkerTokens)


class ClientGone(Exception):
    """The HTTP client disconnected before the response was ready."""


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` unless the client disconnects first (then cancel it and
    raise :class:`ClientGone`). Cancelling the caller cancels both."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.create_task(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (watcher, task):
            if not pending.done():
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pending
    if task.cancelled():
        raise ClientGone
    return task.result()


def _usage(totals: UsageTotals) -> dict[str, Any]:
    return usage_dict(
        totals.prompt_tokens, totals.completion_tokens, totals.cached_tokens,
        totals.tier_cached_tokens,
    )


def _delta_chunk(kind: Kind, meta: ResponseMeta, item: ChoiceDelta, first: bool) -> dict[str, Any]:
    if kind == "chat":
        return chat_chunk(
            meta,
            item.index,
            role="assistant" if first else None,
            content=item.text,
            finish_reason=item.finish_reason,
            logprobs=item.logprobs,
        )
    return text_chunk(meta, item.index, item.text, item.finish_reason, item.logprobs)


def _carries_output(item: ChoiceDelta) -> bool:
    return bool(item.text or item.finish_reason or item.logprobs)


async def sse_body(
    kind: Kind,
    meta: ResponseMeta,
    first: ChoiceDelta | UsageTotals,
    rest: _Stream,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    """SSE frames of a streamed response; an engine failure mid-stream ends it with
    an error frame (the status line is already sent)."""
    started: set[int] = set()
    item: ChoiceDelta | UsageTotals | None = first
    try:
        while item is not None:
            if isinstance(item, ChoiceDelta):
                if item.index not in started or _carries_output(item):
                    yield sse_event(_delta_chunk(kind, meta, item, item.index not in started))
                started.add(item.index)
            elif include_usage:
                yield sse_event(usage_chunk(kind, meta, _usage(item)))
            item = await anext(rest, None)
    except Exception:
        log.exception("engine failed while streaming %s", meta.id)
        yield sse_event(error_body("The engine failed while generating", type=SERVER_ERROR))
    finally:
        await rest.aclose()
    yield SSE_DONE


async def _first(stream: _Stream) -> ChoiceDelta | UsageTotals:
    return await anext(stream)


def _prompt_headers(first: ChoiceDelta | UsageTotals) -> dict[str, str]:
    """The prompt and prefix-cached token counts the first engine item carries."""
    if first.prompt_tokens is None or first.cached_tokens is None:
        return {}
    return {PROMPT_TOKENS_HEADER: str(first.prompt_tokens),
            CACHED_TOKENS_HEADER: str(first.cached_tokens)}


class WorkerService:
    """The request handling behind the routes; knows the engine, not HTTP routing."""

    def __init__(self, engine: AsyncEngineClient, config: WorkerConfig) -> None:
        self.engine = engine
        self.config = config
        self.instance_id = uuid.uuid4().hex
        self.model_names = config.served_model_names or (engine.model_name,)

    def prepare(self, request: OpenAIRequest) -> PreparedRequest:
        """Validate the model name and turn the request into engine input."""
        if request.model not in self.model_names:
            raise OpenAIError(
                f"The model '{request.model}' does not exist on this worker",
                status=404,
                param="model",
                code="model_not_found",
            )
        salt = request.salt_bytes()
        prepared = prepare(
            request,
            self.engine.tokenizer(),
            self.engine.max_model_len,
            TenantSalt(salt) if salt is not None else None,
        )
        share = request.kvtoll_kv_share
        if share is None:
            return prepared
        kv_share = KVShare(share.tenant, share.reserved_blocks, share.max_blocks)
        return dataclasses.replace(prepared, kv_share=kv_share)

    async def respond(self, kind: Kind, http_request: Request) -> Response:
        """Answer one chat or completions request."""
        body = await read_json_body(http_request, self.config.max_body_bytes)
        request = parse_request(kind, body)
        prepared = self.prepare(request)
        meta = ResponseMeta.new(kind, request.model)
        stream = run_prepared(self.engine, prepared, meta.id)
        try:
            if request.stream:
                return await self._stream(kind, meta, stream, request.include_usage(), http_request)
            return await self._whole(kind, meta, stream, prepared.num_choices, http_request)
        except EngineRejected as exc:
            raise rejection_error(exc) from None
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED_REQUEST)

    async def _whole(
        self, kind: Kind, meta: ResponseMeta, stream: _Stream, num_choices: int, request: Request
    ) -> Response:
        result = await until_disconnect(request, collect(stream, num_choices))
        build = chat_completion if kind == "chat" else text_completion
        return JSONResponse(build(meta, result.choices, _usage(result.usage)))

    async def _stream(
        self, kind: Kind, meta: ResponseMeta, stream: _Stream, include_usage: bool, request: Request
    ) -> Response:
        first = await until_disconnect(request, _first(stream))
        body = sse_body(kind, meta, first, stream, include_usage)
        headers = {**SSE_HEADERS, **_prompt_headers(first)}
        return StreamingResponse(body, media_type=SSE_MEDIA_TYPE, headers=headers)

    def kv_events(self, cursor: int, limit: int) -> dict[str, Any]:
        """Ordered block events from ``cursor`` and the cursor to ask with next."""
        events = self.engine.kv_events(cursor, limit)
        return {
            "instance_id": self.instance_id,
            "block_size": self.engine.block_size,
            "events": [
                {
                    "seq": e.seq,
                    "kind": e.kind.value,
                    "block_hashes": [h.hex() for h in e.block_hashes],
                    "tenant": e.tenant,
                }
                for e in events
            ],
            "next_cursor": events[-1].seq + 1 if events else cursor,
        }

    def models(self) -> dict[str, Any]:
        """The ``/v1/models`` list."""
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "kvtoll",
                    "max_model_len": self.engine.max_model_len,
                    "kvtoll": {"dtype": self.engine.dtype},
                }
                for name in self.model_names
            ],
        }


def build_worker_app(
    engine: AsyncEngineClient,
    config: WorkerConfig | None = None,
    metrics: Callable[[], str] | None = None,
) -> FastAPI:
    """The worker's FastAPI app around an already-built engine; ``metrics``: more
    Prometheus text (tier 2's counters) that ``GET /metrics`` serves after the engine's."""
    service = WorkerService(engine, config or WorkerConfig())
    app = FastAPI(title="kvtoll worker", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    app.add_middleware(WorkerAuth, tokens=service.config.tokens)
    app.state.worker = service

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await service.respond("chat", request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await service.respond("completion", request)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return service.models()

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "model": service.model_names[0], "instance_id": service.instance_id}

    @app.get("/load")
    async def load() -> dict[str, Any]:
        return {**asdict(engine.load()), "instance_id": service.instance_id}

    worker_metrics = WorkerMetrics(engine.load)
    extra_metrics = metrics  # tier 2's counters, appended after the engine's own

    @app.get("/metrics")
    async def metrics_route() -> Response:
        body = worker_metrics.render()
        if extra_metrics is not None:
            body += extra_metrics().encode()
        return Response(body, media_type=CONTENT_TYPE)

    @app.get("/kv/events")
    async def kv_events(
        cursor: int = Query(0, ge=0), limit: int = Query(1000, ge=1, le=10_000)
    ) -> dict[str, Any]:
        return service.kv_events(cursor, limit)

    @app.put("/kv/shares")
    async def kv_shares(request: Request) -> dict[str, Any]:
        body = await read_json_body(request, service.config.max_body_bytes)
        return {**apply_shares(engine, body), "instance_id": service.instance_id}

    return app
