"""The fixed-latency OpenAI-compatible upstream the gateway benches put behind kvtoll and
its peers: a raw ASGI app (``/healthz``, ``/v1/models``, and after ``latency_s`` of sleep a
short chat completion, streamed or whole; any other path is a 404, as on vLLM), served by
uvicorn in a process of its own.

Before, every path answered 200, so the gateway took this server for a kvtoll worker
(``GET /load`` answered) and polled its ``/kv/events`` ten times a second with httpx:
10% of the gateway's GIL samples under load and a spike train at 0.11 s in the added
latency, work no gateway does in front of a plain OpenAI server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

MODEL = "fixed-latency"
NOT_FOUND = b'{"detail":"Not Found"}'
PATHS = {"/healthz": b'{"status":"ok"}', "/health": b'{"status":"ok"}'}
ASGIReceive = Callable[[], Awaitable[dict[str, Any]]]
ASGISend = Callable[[dict[str, Any]], Awaitable[None]]


def _completion(stream: bool) -> list[bytes]:
    meta = {"id": "chatcmpl-bench", "created": 0, "model": MODEL}
    usage = {"prompt_tokens": 12, "completion_tokens": 4, "total_tokens": 16,
             "prompt_tokens_details": {"cached_tokens": 0}}
    if not stream:
        body = {**meta, "object": "chat.completion", "usage": usage, "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "one two three four"},
             "finish_reason": "stop", "logprobs": None}]}
        return [json.dumps(body).encode()]
    frames = []
    words = ["one", " two", " three", " four"]
    for i, word in enumerate(words):
        choice = {"index": 0, "delta": {"content": word}, "logprobs": None,
                  "finish_reason": "stop" if i == len(words) - 1 else None}
        chunk = {**meta, "object": "chat.completion.chunk", "choices": [choice]}
        frames.append(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    last = {**meta, "object": "chat.completion.chunk", "choices": [], "usage": usage}
    frames.append(b"data: " + json.dumps(last).encode() + b"\n\n")
    frames.append(b"data: [DONE]\n\n")
    return frames


def make_upstream(latency_s: float) -> Callable[..., Awaitable[None]]:
    """A raw ASGI app: /healthz, /v1/models and a fixed chat completion."""
    whole, streamed = _completion(False), _completion(True)
    models = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()

    async def app(scope: dict[str, Any], receive: ASGIReceive, send: ASGISend) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        path = scope["path"]
        if path != "/v1/chat/completions":
            # as vLLM and other OpenAI servers: kvtoll's worker paths (/load, /kv/events)
            # are unknown here, so the gateway treats this as a plain server
            payload = models if path == "/v1/models" else PATHS.get(path, NOT_FOUND)
            await _send(send, [payload], "application/json",
                        404 if payload is NOT_FOUND else 200)
            return
        await asyncio.sleep(latency_s)
        stream = b'"stream":true' in body.replace(b" ", b"")
        await _send(send, streamed if stream else whole,
                    "text/event-stream" if stream else "application/json")

    return app


async def _send(send: ASGISend, parts: list[bytes], content_type: str,
                status: int = 200) -> None:
    headers = [(b"content-type", content_type.encode())]
    if len(parts) == 1:
        headers.append((b"content-length", str(len(parts[0])).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    for i, part in enumerate(parts):
        await send({"type": "http.response.body", "body": part,
                    "more_body": i < len(parts) - 1})


def serve_upstream(latency_ms: float, port: int) -> None:
    import uvicorn

    uvicorn.run(make_upstream(latency_ms / 1000), host="127.0.0.1", port=port,
                log_level="warning", access_log=False, lifespan="off")
