"""HttpUpstream's chunk-by-chunk SSE parser gives the same events as the engine's
line-by-line reader, wherever the chunk boundaries fall."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from engine.serving.sse import aiter_byte_lines, aiter_sse_data
from proxy.upstream.http import _SseEvents

STREAM = (
    ": keep-alive comment\r\n"
    "event: message\r\n"
    'data: {"a": "héllo ✓"}\r\n\r\n'
    "data: line one\n"
    "data:line two\n"
    "id: 7\n\n"
    "\n\n"
    "data: [DONE]\n\n"
    "data: trailing without blank line"
).encode()


async def _reference() -> list[str]:
    async def chunks() -> AsyncIterator[bytes]:
        yield STREAM

    out = [d async for d in aiter_sse_data(aiter_byte_lines(chunks()))]
    return out


def _split(step: int) -> list[str]:
    events = _SseEvents()
    out: list[str] = []
    for i in range(0, len(STREAM), step):
        out += events.feed(STREAM[i:i + step])
    return out + events.close()


def test_events_match_the_line_reader_for_every_chunk_size() -> None:
    expected = asyncio.run(_reference())
    assert expected[:3] == ['{"a": "héllo ✓"}', "line one\nline two", "[DONE]"]
    for step in range(1, len(STREAM) + 1):
        got = _split(step)
        assert got[:3] == expected, step  # the reference stops after [DONE]
        assert got[3:] == ["trailing without blank line"], step
