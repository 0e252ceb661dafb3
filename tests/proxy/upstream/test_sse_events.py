"""HttpUpstream's chunk-by-chunk SSE parser gives the same events as the engine's
line-by-line reader (as UTF-8 bytes), wherever the chunk boundaries fall, also inside a
multi-byte character."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from kvtoll.openai.sse import aiter_byte_lines, aiter_sse_data
from proxy.upstream.sse_events import SseEvents

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


# What servers send (lines end in "\n" alone): chunks that start on an event boundary
# take the block-splitting fast path, the others the line-by-line one.
PLAIN_STREAM = (
    'data: {"a": "héllo ✓"}\n\n'
    ": keep-alive comment\n\n"
    "data: line one\ndata:line two\nid: 7\n\n"
    "data:\n\n"
    "data: \n\n"
    "\n\n\n"
    "event: x\ndata: after an event field\n\n"
    "data: [DONE]\n\n"
    "data: trailing without blank line"
).encode()


async def _reference(stream: bytes = STREAM) -> list[str]:
    async def chunks() -> AsyncIterator[bytes]:
        yield stream

    out = [d async for d in aiter_sse_data(aiter_byte_lines(chunks()))]
    return out


def _split(step: int, stream: bytes = STREAM) -> list[str]:
    events = SseEvents()
    out: list[bytes] = []
    for i in range(0, len(stream), step):
        out += events.feed(stream[i:i + step])
    return [event.decode("utf-8") for event in out + events.close()]


def test_events_match_the_line_reader_for_every_chunk_size() -> None:
    expected = asyncio.run(_reference())
    assert expected[:3] == ['{"a": "héllo ✓"}', "line one\nline two", "[DONE]"]
    for step in range(1, len(STREAM) + 1):
        got = _split(step)
        assert got[:3] == expected, step  # the reference stops after [DONE]
        assert got[3:] == ["trailing without blank line"], step


def test_plain_streams_match_the_line_reader_for_every_chunk_size() -> None:
    expected = asyncio.run(_reference(PLAIN_STREAM))
    assert expected == ['{"a": "héllo ✓"}', "line one\nline two", "", "",
                        "after an event field", "[DONE]"]
    for step in range(1, len(PLAIN_STREAM) + 1):
        got = _split(step, PLAIN_STREAM)
        assert got[:6] == expected, step
        assert got[6:] == ["trailing without blank line"], step
    events = SseEvents()  # several whole events in one chunk, then a split one
    assert events.feed(b"data: 1\n\ndata: 2\n\ndata: 3") == [b"1", b"2"]
    assert events.feed(b"3\n\n") == [b"33"]
