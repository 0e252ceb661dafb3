"""Gateway ↔ worker trust: the shared worker token and signed worker registrations.

Every gateway call to a worker carries ``Authorization: Bearer <worker token>``; a
worker refuses any request without a token it accepts (its current one, or the
previous one while a rotation is under way). A worker that announces itself in
Redis signs its record with HMAC-SHA256 under each token it accepts, so a gateway
takes a registration only from someone who holds a worker token, and only until the
record's ``expires_at`` (unix seconds).

Rotation without downtime (old token A, new token B):

1. restart each worker with ``KVTOLL_WORKER_TOKEN=B KVTOLL_WORKER_TOKEN_PREVIOUS=A``
   (it accepts both, signs its registration with both);
2. restart each gateway with ``KVTOLL_WORKER_TOKEN=B``;
3. restart each worker without ``KVTOLL_WORKER_TOKEN_PREVIOUS``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MIN_TOKEN_LENGTH = 16
_SIGNING_CONTEXT = b"kvtoll-worker-registration:"


@dataclass(frozen=True)
class WorkerTokens:
    """The tokens a worker accepts (current first); empty: no authentication (dev mode)."""

    current: str = ""
    previous: str = ""

    def __post_init__(self) -> None:
        if self.previous and not self.current:
            raise ValueError("a previous worker token needs a current one")

    @property
    def enabled(self) -> bool:
        return bool(self.current)

    def accepted(self) -> tuple[str, ...]:
        return tuple(t for t in (self.current, self.previous) if t)

    def matches(self, presented: str) -> bool:
        """Constant-time: is ``presented`` one of the accepted tokens?"""
        given = presented.encode()
        found = False
        for token in self.accepted():  # compare with every token: no early exit
            found |= hmac.compare_digest(given, token.encode())
        return found


def bearer_headers(token: str) -> dict[str, str]:
    """The header a gateway sends with every worker call (none without a token)."""
    return {"authorization": f"Bearer {token}"} if token else {}


def presented_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer`` header, ``None`` if absent or another scheme."""
    if not authorization:
        return None
    scheme, _, value = authorization.strip().partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


def _canonical(fields: Mapping[str, Any]) -> bytes:
    return _SIGNING_CONTEXT + json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def sign_record(tokens: Sequence[str], fields: Mapping[str, Any]) -> list[str]:
    """HMAC-SHA256 of ``fields`` (canonical JSON) under each token, hex."""
    payload = _canonical(fields)
    return [hmac.new(t.encode(), payload, hashlib.sha256).hexdigest() for t in tokens if t]


def verify_record(token: str, fields: Mapping[str, Any], signatures: Sequence[object]) -> bool:
    """Does one of ``signatures`` sign ``fields`` under ``token``? (constant-time each)"""
    if not token:
        return False
    expected = sign_record([token], fields)[0].encode()
    found = False
    for signature in signatures:
        if isinstance(signature, str) and signature.isascii():
            found |= hmac.compare_digest(expected, signature.encode())
    return found
