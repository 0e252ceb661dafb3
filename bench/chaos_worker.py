"""The slow-streaming OpenAI-compatible worker of ``bench/chaos.py``: ``/healthz``,
``/v1/models`` and chat completions that stream ``num_words`` one-word deltas,
``delay_s`` apart, then the usage (``completion_tokens`` = words sent), so a stream
is long enough to be cut. Served by uvicorn in a process of its own::

    python -m bench.chaos_worker PORT NUM_WORDS DELAY_S
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from typing import Any

MODEL = "chaos-model"
PROMPT_TOKENS = 8
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def _frame(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def make_worker(num_words: int, delay_s: float) -> Callable[..., Awaitable[None]]:
    """The raw ASGI app (see module doc)."""
    models = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()
    meta = {"id": "chatcmpl-chaos", "created": 0, "model": MODEL,
            "object": "chat.completion.chunk"}

    async def app(scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        path = scope["path"]
        if path != "/v1/chat/completions":
            known = path in ("/v1/models", "/healthz", "/health")
            body = models if path == "/v1/models" else b'{"status":"ok"}'
            await send({"type": "http.response.start", "status": 200 if known else 404,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body if known else b"{}"})
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for i in range(num_words):
            await asyncio.sleep(delay_s)
            choice = {"index": 0, "delta": {"content": f"w{i} "}, "logprobs": None,
                      "finish_reason": "stop" if i == num_words - 1 else None}
            await send({"type": "http.response.body", "body": _frame({**meta, "choices": [choice]}),
                        "more_body": True})
        usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": num_words,
                 "total_tokens": PROMPT_TOKENS + num_words,
                 "prompt_tokens_details": {"cached_tokens": 0}}
        await send({"type": "http.response.body",
                    "body": _frame({**meta, "choices": [], "usage": usage}) + b"data: [DONE]\n\n"})

    return app


def main(port: int, num_words: int, delay_s: float) -> None:
    import uvicorn

    uvicorn.run(make_worker(num_words, delay_s), host="127.0.0.1", port=port,
                log_level="warning", lifespan="off")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
