from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest

from kvtoll.openai.sse import SSE_DONE, aiter_byte_lines, aiter_sse_data, sse_event

pytestmark = pytest.mark.anyio


async def _lines(text: str) -> AsyncIterator[str]:
    for line in text.splitlines():
        yield line


async def _iter(lines: list[str]) -> AsyncIterator[str]:
    for line in lines:
        yield line


async def _data(text: str) -> list[str]:
    return [d async for d in aiter_sse_data(_lines(text))]


def test_sse_event_frames_compact_json_with_unicode() -> None:
    frame = sse_event({"a": "é", "b": [1, 2]})
    assert frame == 'data: {"a":"é","b":[1,2]}\n\n'.encode()
    assert SSE_DONE == b"data: [DONE]\n\n"


async def test_round_trip_of_framed_events() -> None:
    payloads = [{"i": i, "text": "line\nbreak"} for i in range(3)]
    stream = b"".join(sse_event(p) for p in payloads) + SSE_DONE
    data = await _data(stream.decode())
    assert [json.loads(d) for d in data[:-1]] == payloads
    assert data[-1] == "[DONE]"


async def test_parser_rules_comments_fields_multiline_crlf_and_stop_at_done() -> None:
    text = (
        ": keep-alive\r\n"
        "event: message\r\nid: 7\r\ndata: first\r\ndata:second\r\n\r\n"
        "\r\n"
        "data: [DONE]\r\n\r\n"
        "data: after-done\r\n\r\n"
    )
    assert await _data(text) == ["first\nsecond", "[DONE]"]


async def test_stream_is_drained_after_done() -> None:
    consumed: list[str] = []

    async def lines() -> AsyncIterator[str]:
        for line in ["data: a", "", "data: [DONE]", "", "", ": trailing"]:
            consumed.append(line)
            yield line

    assert [d async for d in aiter_sse_data(lines())] == ["a", "[DONE]"]
    assert consumed[-1] == ": trailing"


async def test_last_event_without_blank_line_is_delivered() -> None:
    assert await _data("data: x\n\ndata: tail") == ["x", "tail"]


async def test_byte_lines_split_across_chunks_and_multibyte_text() -> None:
    text = "data: {\"t\":\"héllo ✓\"}\r\n\r\ndata: [DONE]\n\n".encode()

    async def chunks(size: int) -> AsyncIterator[bytes]:
        for i in range(0, len(text), size):
            yield text[i:i + size]

    for size in (1, 2, 3, 7, len(text)):  # splits inside multi-byte characters too
        lines = [line async for line in aiter_byte_lines(chunks(size))]
        assert [d async for d in aiter_sse_data(_iter(lines))] == ['{"t":"héllo ✓"}', "[DONE]"]
