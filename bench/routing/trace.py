"""Mooncake-format request traces for the routing simulator.

One JSON object per line: ``{"timestamp": ms, "input_length": tokens,
"output_length": tokens, "hash_ids": [int, ...]}``; each hash id names one 512-token
block and equal leading ids mean a shared prefix. The ids are treated as already
salted, chained block hashes: id *k* maps to ``BlockHash(k as 16 big-endian bytes)``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.kv.hashing import BlockHash

MOONCAKE_BLOCK_SIZE = 512
SESSION_KEY_BLOCKS = 2  # the trace has no session ids: its first blocks stand in for one


@dataclass(frozen=True)
class TraceRequest:
    """One replayed request."""

    arrival_s: float
    input_length: int
    output_length: int
    block_hashes: tuple[BlockHash, ...]

    @property
    def session_key(self) -> str:
        """A stand-in session key: the request's first ``SESSION_KEY_BLOCKS`` block ids."""
        return "-".join(h.hex() for h in self.block_hashes[:SESSION_KEY_BLOCKS])


def block_hash_of_id(hash_id: int) -> BlockHash:
    """The deterministic BlockHash for a trace hash id."""
    if hash_id < 0:
        raise ValueError(f"hash ids must be non-negative, got {hash_id}")
    return BlockHash(hash_id.to_bytes(16, "big"))


def parse_trace_line(line: str, line_no: int) -> TraceRequest:
    """One request from one JSONL line; ``ValueError`` names the line when malformed."""
    try:
        row = json.loads(line)
        timestamp = float(row["timestamp"])
        input_length = int(row["input_length"])
        output_length = int(row["output_length"])
        hash_ids = [int(x) for x in row["hash_ids"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"trace line {line_no}: not a Mooncake request ({exc})") from exc
    if input_length <= 0 or output_length < 0 or timestamp < 0:
        raise ValueError(f"trace line {line_no}: negative or empty lengths/timestamp")
    return TraceRequest(
        arrival_s=timestamp / 1000.0,
        input_length=input_length,
        output_length=output_length,
        block_hashes=tuple(block_hash_of_id(x) for x in hash_ids),
    )


def parse_trace(lines: Iterable[str]) -> list[TraceRequest]:
    """Requests sorted by arrival (stable for equal timestamps); blank lines skipped."""
    requests = [parse_trace_line(line, i) for i, line in enumerate(lines, start=1) if line.strip()]
    requests.sort(key=lambda r: r.arrival_s)
    return requests


def load_trace(path: Path, limit: int | None = None) -> list[TraceRequest]:
    """Read a trace file; ``limit`` keeps the first N requests."""
    with path.open(encoding="utf-8") as f:
        requests = parse_trace(f)
    return requests[:limit] if limit is not None else requests


def infinite_cache_hit_rate(requests: Sequence[TraceRequest], block_size: int) -> float:
    """Ceiling: cached/input tokens if one worker had an unbounded cache."""
    seen: set[BlockHash] = set()
    cached = total = 0
    for r in requests:
        matched = 0
        for h in r.block_hashes:
            if h not in seen:
                break
            matched += 1
        cached += min(r.input_length, matched * block_size)
        total += r.input_length
        seen.update(r.block_hashes)
    return cached / total if total else 0.0
