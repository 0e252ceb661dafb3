"""Server-sent events as OpenAI streams them: ``data: <json>\\n\\n`` frames ending
with ``data: [DONE]\\n\\n``; and the reverse, reading such a stream line by line.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

from kvtoll import fastjson

SSE_DONE = b"data: [DONE]\n\n"
SSE_MEDIA_TYPE = "text/event-stream"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE_SENTINEL = "[DONE]"
# kvtoll extension headers on a worker's streamed response, known from the engine's
# first chunk (the response starts after it): the prompt's tokens and how many came
# from the prefix cache. OpenAI clients ignore them; the kvtoll gateway reads them.
PROMPT_TOKENS_HEADER = "x-kvtoll-prompt-tokens"
CACHED_TOKENS_HEADER = "x-kvtoll-cached-tokens"


def sse_event(payload: dict[str, Any]) -> bytes:
    """One ``data:`` frame carrying ``payload`` as compact JSON."""
    return b"data: " + fastjson.dumps(payload) + b"\n\n"


async def aiter_byte_lines(chunks: AsyncIterable[bytes]) -> AsyncIterator[str]:
    """Lines (without ``\n``) of a UTF-8 byte stream, for :func:`aiter_sse_data`.

    Cheaper than ``httpx.Response.aiter_lines`` (no incremental text decoder): a
    ``\n`` byte never occurs inside a multi-byte UTF-8 character, so each line is
    decoded whole. A ``\r`` before the ``\n`` is left for the caller to strip."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        if b"\n" not in chunk:
            continue
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            yield line.decode("utf-8", errors="replace")
    if buffer:
        yield buffer.decode("utf-8", errors="replace")


async def aiter_sse_data(lines: AsyncIterable[str]) -> AsyncIterator[str]:
    """The ``data`` of each event in a stream of lines (already split, no newlines).

    Follows the SSE rules that matter here: ``data:`` lines of one event are joined
    with ``\\n``, a blank line ends an event, ``:`` lines are comments, other fields
    (``event:``, ``id:``, ``retry:``) are ignored. A final event without its blank
    line is still delivered. Nothing is yielded after ``[DONE]``, but the rest of the
    stream is still read, so that an HTTP connection can go back to its pool.
    """
    pending: list[str] = []
    async for raw in lines:
        line = raw.rstrip("\r")
        if not line:
            if pending:
                data = "\n".join(pending)
                pending = []
                yield data
                if data == DONE_SENTINEL:
                    async for _ in lines:
                        pass
                    return
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        if field == "data":
            pending.append(value[1:] if value.startswith(" ") else value)
    if pending:
        yield "\n".join(pending)
