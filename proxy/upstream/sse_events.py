"""Server-sent events parsed from an HTTP body chunk by chunk (the upstream read path)."""

from __future__ import annotations


class SseEvents:
    """Server-sent events parsed chunk by chunk, without a generator per line: the
    ``data`` of each complete event (the rules of ``kvtoll.openai.sse.aiter_sse_data``:
    ``data:`` lines joined with ``\\n``, a blank line ends an event, ``:`` comments and
    other fields ignored). A ``\\n`` byte never occurs inside a multi-byte UTF-8
    character, so each line is decoded whole."""

    def __init__(self) -> None:
        self._buffer = b""
        self._pending: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        """The events completed by ``chunk``."""
        if not self._buffer and not self._pending and b"\r" not in chunk:
            return self._feed_blocks(chunk)
        self._buffer += chunk
        if b"\n" not in chunk:
            return []
        *lines, self._buffer = self._buffer.split(b"\n")
        out: list[str] = []
        for raw in lines:
            self._line(raw.decode("utf-8", errors="replace").rstrip("\r"), out)
        return out

    def _feed_blocks(self, chunk: bytes) -> list[str]:
        """:meth:`feed` when no event is half read and lines end in ``\n`` alone (what
        servers send): split on blank lines, and a block that is one ``data: `` line is
        its event as it stands; any other block goes line by line."""
        *blocks, tail = chunk.split(b"\n\n")
        out: list[str] = []
        for block in blocks:
            if block.startswith(b"data: ") and b"\n" not in block:
                out.append(block[6:].decode("utf-8", errors="replace"))
                continue
            for raw in block.split(b"\n"):
                self._line(raw.decode("utf-8", errors="replace"), out)
            self._line("", out)  # the blank line that ended the block
        *lines, self._buffer = tail.split(b"\n")
        for raw in lines:
            self._line(raw.decode("utf-8", errors="replace"), out)
        return out

    def close(self) -> list[str]:
        """At the end of the body: a last event without its blank line."""
        out: list[str] = []
        if self._buffer:
            self._line(self._buffer.decode("utf-8", errors="replace").rstrip("\r"), out)
            self._buffer = b""
        if self._pending:
            out.append("\n".join(self._pending))
            self._pending = []
        return out

    def _line(self, line: str, out: list[str]) -> None:
        if not line:
            if self._pending:
                out.append("\n".join(self._pending))
                self._pending = []
        elif not line.startswith(":"):
            field, _, value = line.partition(":")
            if field == "data":
                self._pending.append(value[1:] if value.startswith(" ") else value)
