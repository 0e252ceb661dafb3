"""The wire format of workers' scale-out records in Redis, for both sides: the worker
that writes them (:mod:`engine.serving.kv_publish`) and the router that reads them.

Announcement: key ``{prefix}workers:{name}`` holding JSON ``{"url", "kv_events",
"instance_id"}`` with a TTL. KV events: stream ``{prefix}kv:{name}``, one entry per
engine event with fields ``instance``, ``seq``, ``kind`` and ``hashes``
(comma-separated hex block hashes).
"""

from __future__ import annotations

import json
from typing import Literal

from engine.api import KVEvent

EventTransport = Literal["http", "redis", "none"]
DEFAULT_PREFIX = "kvtoll:"


def announcement_key(prefix: str, name: str) -> str:
    """The Redis key a worker called ``name`` announces itself under."""
    return f"{prefix}workers:{name}"


def stream_key(prefix: str, worker_name: str) -> str:
    """The Redis stream a worker's KV events go to."""
    return f"{prefix}kv:{worker_name}"


def parse_announcement(body: bytes | str | None) -> tuple[str, EventTransport, str | None] | None:
    """``(url, kv_events, instance_id)`` of an announcement, None if malformed."""
    if body is None:
        return None
    try:
        data = json.loads(body)
        url = str(data["url"])
        transport = data.get("kv_events", "http")
    except (ValueError, KeyError, TypeError):
        return None
    if transport not in ("http", "redis", "none"):
        transport = "none"
    instance = data.get("instance_id")
    return url, transport, str(instance) if instance is not None else None


def event_fields(instance_id: str, event: KVEvent) -> dict[str, str]:
    """One stream entry's fields."""
    return {
        "instance": instance_id,
        "seq": str(event.seq),
        "kind": event.kind.value,
        "hashes": ",".join(h.hex() for h in event.block_hashes),
    }
