"""Helpers for upstream tests: a spy around the real engine and a scripted
OpenAI-compatible server standing in for third-party servers (vLLM, SGLang)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.api import (
    AsyncEngineClient,
    EngineLoad,
    GenerationChunk,
    GenerationRequest,
    KVEvent,
    Tokenizer,
)


@dataclass
class SpyEngine:
    """Delegates to a real engine; records requests and streams closed before the end.
    ``chunk_delay_s`` slows the consumer side only (the engine runs at full speed)."""

    inner: AsyncEngineClient
    chunk_delay_s: float = 0.0
    requests: list[GenerationRequest] = field(default_factory=list)
    closed_early: list[str] = field(default_factory=list)

    @property
    def model_name(self) -> str:
        return self.inner.model_name

    @property
    def block_size(self) -> int:
        return self.inner.block_size

    @property
    def dtype(self) -> str:
        return self.inner.dtype

    @property
    def max_model_len(self) -> int:
        return self.inner.max_model_len

    def tokenizer(self) -> Tokenizer:
        return self.inner.tokenizer()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        self.requests.append(request)
        done = False
        try:
            async for chunk in self.inner.generate(request):
                await asyncio.sleep(self.chunk_delay_s)
                yield chunk
            done = True
        finally:
            if not done:
                self.closed_early.append(request.request_id)

    async def abort(self, request_id: str) -> None:
        await self.inner.abort(request_id)

    def load(self) -> EngineLoad:
        return self.inner.load()

    def kv_events(self, cursor: int, limit: int = 1000) -> list[KVEvent]:
        return self.inner.kv_events(cursor, limit)


@dataclass
class Script:
    """What the scripted server answers next; it records what it received."""

    status: int = 200
    error_body: Any = None
    events: list[Any] = field(default_factory=list)  # dicts, or raw strings or bytes
    send_done: bool = True
    delay_s: float = 0.0
    has_healthz: bool = True
    whole_json: Any = None  # answer this JSON object instead of streaming
    received: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)


def scripted_server(script: Script) -> FastAPI:
    """An OpenAI-compatible server that plays ``script`` on both completion routes."""
    app = FastAPI()

    async def frames() -> AsyncIterator[bytes]:
        for event in script.events:
            await asyncio.sleep(script.delay_s)
            if isinstance(event, bytes):  # sent as it is (e.g. not UTF-8)
                yield b"data: " + event + b"\n\n"
                continue
            data = event if isinstance(event, str) else json.dumps(event)
            yield f"data: {data}\n\n".encode()
        if script.send_done:
            yield b"data: [DONE]\n\n"

    async def answer(request: Request) -> Response:
        script.received.append(await request.json())
        script.headers.append(dict(request.headers))
        if script.status != 200:
            return JSONResponse(script.error_body, status_code=script.status)
        if script.whole_json is not None:
            await asyncio.sleep(script.delay_s)  # silent until the whole answer is ready
            return JSONResponse(script.whole_json)
        return StreamingResponse(frames(), media_type="text/event-stream")

    app.add_api_route("/v1/chat/completions", answer, methods=["POST"])
    app.add_api_route("/v1/completions", answer, methods=["POST"])

    @app.get("/healthz")
    async def healthz() -> Response:
        return Response(status_code=200 if script.has_healthz else 404)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "m", "object": "model"}]}

    return app


def chat_event(index: int, content: str | None, finish: str | None = None) -> dict[str, Any]:
    delta = {} if content is None else {"content": content}
    return {
        "id": "x",
        "object": "chat.completion.chunk",
        "choices": [{"index": index, "delta": delta, "finish_reason": finish}],
    }
