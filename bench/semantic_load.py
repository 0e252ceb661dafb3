"""A lean closed-loop HTTP/1.1 load client for ``semantic_http.py``.

httpx's AsyncClient spends ~5 ms of CPU per request at 32 connections on this CPU, as
much as the gateway it measures, on the same two cores. This client does only what the
bench needs: one keep-alive connection per worker, a pre-encoded POST, the status line,
the headers (``content-length`` or ``transfer-encoding: chunked``, ``x-kvtoll-cache``)
and the body read off the socket. Every response is read in full and its status checked;
a body that is not a JSON object counts as an error.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit


@dataclass
class Counts:
    semantic: int = 0
    other: int = 0
    errors: int = 0
    statuses: dict[int, int] = field(default_factory=dict)


def encode_post(host: str, path: str, headers: dict[str, str], body: dict[str, Any]) -> bytes:
    payload = json.dumps(body).encode()
    lines = [
        f"POST {path} HTTP/1.1",
        f"Host: {host}",
        "Content-Type: application/json",
        f"Content-Length: {len(payload)}",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """Status, lower-cased headers and the whole body of one response."""
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    status = int(status_line.split(" ", 2)[1])
    headers: dict[str, str] = {}
    for line in header_lines:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        return status, headers, await reader.readexactly(int(headers["content-length"]))
    if headers.get("transfer-encoding", "").lower() == "chunked":
        chunks: list[bytes] = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                return status, headers, b"".join(chunks)
            chunks.append(chunk[:-2])
    raise RuntimeError("response without content-length or chunked encoding")


async def closed_loop(
    url: str,
    headers: dict[str, str],
    bodies: Callable[[int], dict[str, Any]],
    concurrency: int,
    seconds: float,
) -> tuple[Counts, float]:
    """``concurrency`` workers, each sending ``bodies(n)`` for its n-th request over one
    keep-alive connection until ``seconds`` have passed; returns counts and elapsed s."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    path = (parts.path.rstrip("/") or "") + "/v1/chat/completions"
    counts = Counts()
    stop_at = time.perf_counter() + seconds

    async def worker(start: int) -> None:
        reader, writer = await asyncio.open_connection(host, port)
        n = start
        try:
            while time.perf_counter() < stop_at:
                n += 1
                writer.write(encode_post(f"{host}:{port}", path, headers, bodies(n)))
                status, response_headers, body = await read_response(reader)
                counts.statuses[status] = counts.statuses.get(status, 0) + 1
                if status != 200 or not body.startswith(b"{"):
                    counts.errors += 1
                elif response_headers.get("x-kvtoll-cache") == "semantic":
                    counts.semantic += 1
                else:
                    counts.other += 1
        finally:
            writer.close()

    started = time.perf_counter()
    await asyncio.gather(*(worker(i * 7) for i in range(concurrency)))
    return counts, time.perf_counter() - started
