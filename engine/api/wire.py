"""The wire format of workers' scale-out records in Redis, for both sides: the worker
that writes them (:mod:`engine.serving.kv_publish`) and the router that reads them.

Announcement: key ``{prefix}workers:{name}`` holding JSON ``{"url", "kv_events",
"instance_id", "expires_at", "sigs"}`` with a TTL: ``expires_at`` is unix seconds and
``sigs`` the record signed under each worker token the worker accepts
(:func:`kvtoll.worker_auth.sign_record` over name, url, kv_events, instance_id and
expires_at), so only a holder of the token can register a worker and a copied record
works only for the same name and URL until it expires. KV events: stream
``{prefix}kv:{name}``, one entry per engine event with fields ``instance``, ``seq``,
``kind``, ``hashes`` (comma-separated hex block hashes) and, for a tenant the gateway
named in its share, ``tenant``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from engine.api import KVEvent
from kvtoll.worker_auth import sign_record, verify_record

EventTransport = Literal["http", "redis", "none"]
DEFAULT_PREFIX = "kvtoll:"
MAX_RECORD_LIFETIME_S = 3600.0  # a record claiming a longer life is refused


@dataclass(frozen=True)
class Announcement:
    """A verified worker registration."""

    url: str
    kv_events: EventTransport
    instance_id: str | None
    expires_at: float


def announcement_key(prefix: str, name: str) -> str:
    """The Redis key a worker called ``name`` announces itself under."""
    return f"{prefix}workers:{name}"


def stream_key(prefix: str, worker_name: str) -> str:
    """The Redis stream a worker's KV events go to."""
    return f"{prefix}kv:{worker_name}"


def _signed_fields(
    name: str, url: str, kv_events: str, instance_id: str | None, expires_at: float
) -> dict[str, Any]:
    return {"name": name, "url": url, "kv_events": kv_events, "instance_id": instance_id,
            "expires_at": expires_at}


def announcement_body(
    name: str,
    url: str,
    kv_events: EventTransport,
    instance_id: str | None,
    expires_at: float,
    tokens: Sequence[str],
) -> str:
    """The JSON a worker writes under its announcement key, signed under ``tokens``."""
    fields = _signed_fields(name, url, kv_events, instance_id, expires_at)
    return json.dumps({**fields, "sigs": sign_record(tokens, fields)})


def parse_announcement(
    body: bytes | str | None, name: str, token: str, now: float
) -> Announcement | None:
    """The announcement of worker ``name`` if well-formed, signed under ``token``, made
    for this name and not expired (nor claiming more than an hour); else ``None``."""
    if body is None or not token:
        return None
    try:
        data = json.loads(body)
        url, transport = str(data["url"]), str(data.get("kv_events", "http"))
        instance = data.get("instance_id")
        expires_at = data["expires_at"]
        signatures = data["sigs"]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(expires_at, int | float) or not isinstance(signatures, list):
        return None
    if instance is not None and not isinstance(instance, str):
        return None
    fields = _signed_fields(name, url, transport, instance, expires_at)
    if not verify_record(token, fields, signatures):
        return None
    if not now < expires_at <= now + MAX_RECORD_LIFETIME_S:
        return None
    kv_events: EventTransport = transport if transport in ("http", "redis") else "none"  # type: ignore[assignment]
    return Announcement(url, kv_events, instance, float(expires_at))


def event_fields(instance_id: str, event: KVEvent) -> dict[str, str]:
    """One stream entry's fields."""
    return {
        "instance": instance_id,
        "seq": str(event.seq),
        "kind": event.kind.value,
        "hashes": ",".join(h.hex() for h in event.block_hashes),
        **({"tenant": event.tenant} if event.tenant else {}),
    }
