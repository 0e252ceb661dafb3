"""Signed, expiring session tokens for the dashboard cookies.

A token is ``base64url(json claims) "." base64url(HMAC-SHA256(key, claims))``.
The key is derived from the server secret and a *purpose* string, so a tenant
session can never pass as an admin session. Claims always carry ``exp`` (unix
seconds) and a random ``nonce``; the API key itself is never inside a token.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
from typing import Any


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class TokenSigner:
    """Issue and verify tokens for one purpose with a fixed lifetime."""

    def __init__(self, secret: bytes, purpose: str, ttl_s: int) -> None:
        if ttl_s <= 0:
            raise ValueError("token lifetime must be positive")
        self._key = hmac.new(secret, b"kvtoll-web:" + purpose.encode(), hashlib.sha256).digest()
        self.ttl_s = ttl_s

    def _sign(self, payload: str) -> str:
        return _b64(hmac.new(self._key, payload.encode(), hashlib.sha256).digest())

    def issue(self, claims: dict[str, Any], now: float) -> str:
        """A token for ``claims`` expiring ``ttl_s`` after ``now``."""
        body = {**claims, "exp": int(now) + self.ttl_s, "nonce": secrets.token_hex(16)}
        payload = _b64(json.dumps(body, separators=(",", ":"), sort_keys=True).encode())
        return f"{payload}.{self._sign(payload)}"

    def verify(self, token: str | None, now: float) -> dict[str, Any] | None:
        """The claims of a genuine, unexpired token, else ``None``."""
        if not token or token.count(".") != 1 or len(token) > 4096:
            return None
        payload, signature = token.split(".")
        if not (payload.isascii() and signature.isascii()):
            return None  # compare_digest refuses non-ASCII str; a forged cookie is not a 500
        if not hmac.compare_digest(self._sign(payload), signature):
            return None
        try:
            claims = json.loads(_unb64(payload))
        except ValueError:
            return None
        if not isinstance(claims, dict) or not isinstance(claims.get("exp"), int):
            return None
        return claims if claims["exp"] > now else None
