"""Server-sent events parsed from an HTTP body chunk by chunk (the upstream read path)."""

from __future__ import annotations


class SseEvents:
    """Server-sent events parsed chunk by chunk, without a generator per line: the
    ``data`` of each complete event, as bytes (the rules of
    ``kvtoll.openai.sse.aiter_sse_data``: ``data:`` lines joined with ``\\n``, a blank
    line ends an event, ``:`` comments and other fields ignored). ``\\n``, ``\\r`` and
    ``:`` never occur inside a multi-byte UTF-8 character, so the bytes are split as the
    text would be; the caller decodes each event once (JSON decodes UTF-8 itself)."""

    def __init__(self) -> None:
        self._buffer = b""
        self._pending: list[bytes] = []

    def feed(self, chunk: bytes) -> list[bytes]:
        """The events completed by ``chunk``."""
        if not self._buffer and not self._pending and b"\r" not in chunk:
            return self._feed_blocks(chunk)
        self._buffer += chunk
        if b"\n" not in chunk:
            return []
        *lines, self._buffer = self._buffer.split(b"\n")
        out: list[bytes] = []
        for raw in lines:
            self._line(raw.rstrip(b"\r"), out)
        return out

    def _feed_blocks(self, chunk: bytes) -> list[bytes]:
        """:meth:`feed` when no event is half read and lines end in ``\\n`` alone (what
        servers send): split on blank lines, and a block that is one ``data: `` line is
        its event as it stands; any other block goes line by line."""
        *blocks, tail = chunk.split(b"\n\n")
        out: list[bytes] = []
        for block in blocks:
            if block.startswith(b"data: ") and b"\n" not in block:
                out.append(block[6:])
                continue
            for raw in block.split(b"\n"):
                self._line(raw, out)
            self._line(b"", out)  # the blank line that ended the block
        *lines, self._buffer = tail.split(b"\n")
        for raw in lines:
            self._line(raw, out)
        return out

    def close(self) -> list[bytes]:
        """At the end of the body: a last event without its blank line."""
        out: list[bytes] = []
        if self._buffer:
            self._line(self._buffer.rstrip(b"\r"), out)
            self._buffer = b""
        if self._pending:
            out.append(b"\n".join(self._pending))
            self._pending = []
        return out

    def _line(self, line: bytes, out: list[bytes]) -> None:
        if not line:
            if self._pending:
                out.append(b"\n".join(self._pending))
                self._pending = []
        elif not line.startswith(b":"):
            field, _, value = line.partition(b":")
            if field == b"data":
                self._pending.append(value[1:] if value.startswith(b" ") else value)
