"""OpenAI-compatible routes: chat completions, completions, model list."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from engine.serving.errors import SERVER_ERROR, OpenAIError, read_body_bytes
from engine.serving.responses import ResponseMeta
from engine.serving.sse import SSE_HEADERS, SSE_MEDIA_TYPE
from proxy.deps import KeyDep, StateDep
from proxy.intake import Kind
from proxy.render import sse_frames, whole_response
from proxy.service import Reply
from proxy.state import ProxyState
from proxy.upstream.base import UpstreamError

router = APIRouter()


def _headers(reply: Reply) -> dict[str, str]:
    headers = {"x-kvtoll-request-id": reply.request_id, "x-kvtoll-cache": reply.cache_header()}
    if reply.worker:
        headers["x-kvtoll-worker"] = reply.worker
    if reply.similarity is not None:
        headers["x-kvtoll-similarity"] = f"{reply.similarity:.4f}"
    return headers


async def _complete(kind: Kind, endpoint: str, request: Request) -> Response:
    # State and key are resolved here rather than with Depends/Header: FastAPI's
    # dependency solver and header validation cost ~0.4 ms per request on this hot path.
    state: ProxyState = request.app.state.kvtoll
    identity = await state.intake.authenticate(request.headers.get("authorization"))

    async def read_body(max_bytes: int) -> bytes:
        return await read_body_bytes(request, max_bytes)

    prep = await state.intake.prepare(
        kind, identity, read_body, request.headers.get("cache-control")
    )
    reply = await state.gateway.open(prep, endpoint)
    meta = ResponseMeta.new(kind, prep.model)
    if prep.request.stream:
        frames = sse_frames(kind, meta, reply.items, prep.request.include_usage())
        return StreamingResponse(
            frames, media_type=SSE_MEDIA_TYPE, headers={**SSE_HEADERS, **_headers(reply)}
        )
    try:
        async for _ in reply.items:
            pass
    except UpstreamError as exc:
        raise OpenAIError(f"upstream failed: {exc}", status=502, type=SERVER_ERROR,
                          code="upstream_error") from exc
    return JSONResponse(whole_response(kind, meta, reply.tally), headers=_headers(reply))


async def chat_completions(request: Request) -> Response:
    """OpenAI chat completions (streamed with ``"stream": true``; Bearer key required)."""
    return await _complete("chat", "chat", request)


async def completions(request: Request) -> Response:
    """OpenAI legacy completions (streamed with ``"stream": true``; Bearer key required)."""
    return await _complete("completion", "completions", request)


# The two completion routes are plain Starlette routes: FastAPI's request handling
# (dependency solving, endpoint wrapper, response serialisation) cost ~0.15 ms per
# request and they use none of it (they validate bodies against the shared schema
# themselves). They are therefore not in /openapi.json.
router.add_route("/v1/chat/completions", chat_completions, methods=["POST"],
                 include_in_schema=False)
router.add_route("/v1/completions", completions, methods=["POST"], include_in_schema=False)


@router.get("/v1/models")
async def list_models(state: StateDep, identity: KeyDep) -> dict[str, object]:
    """The models this gateway serves."""
    created = int(time.time())
    return {
        "object": "list",
        "data": [
            {"id": m, "object": "model", "created": created, "owned_by": "kvtoll"}
            for m in state.models
        ],
    }
