"""Bearer-key authentication with a short positive/negative cache.

``Authorization: Bearer kvt_…`` → :class:`billing.accounts.KeyIdentity`. Order:
header present → key well-formed (prefix, length, alphabet, checksum; no database
query for a typo) → cache → :func:`billing.accounts.resolve_key` (hash lookup).

Cache policy (``ttl_s``, default 5 s; ``max_entries``): answers, positive and
negative, are kept for ``ttl_s`` keyed by the key's sha256. **A revoked key
therefore keeps working for at most ``ttl_s`` seconds on each replica.** If the
database fails while an entry is being refreshed, the last known answer is used
(stale-if-error, up to ``max_stale_s``) so a database outage does not lock out
tenants that were already authenticated; an unknown key with no cached answer
gets a 503 then.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.orm import Session, sessionmaker

from billing import keys
from billing.accounts import KeyIdentity, resolve_key
from kvtoll.openai.errors import INVALID_REQUEST, SERVER_ERROR, OpenAIError

log = logging.getLogger(__name__)


class AuthError(OpenAIError):
    """Refused credentials (401) or an identity store that cannot answer (503)."""

    def __init__(self, message: str, *, code: str = "invalid_api_key", status: int = 401) -> None:
        kind = INVALID_REQUEST if status < 500 else SERVER_ERROR
        super().__init__(message, status=status, type=kind, code=code)


@dataclass(frozen=True)
class _Entry:
    identity: KeyIdentity | None
    expires_at: float
    stale_until: float


def bearer_token(authorization: str | None) -> str:
    """The key in an ``Authorization`` header; :class:`AuthError` if absent or malformed."""
    if not authorization:
        raise AuthError("missing API key: send 'Authorization: Bearer kvt_…'")
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise AuthError("malformed Authorization header: expected 'Bearer kvt_…'")
    if not keys.check_format(token):
        raise AuthError("malformed API key (wrong prefix, length or checksum)")
    return token


class KeyAuthenticator:
    """Resolves keys through the billing layer, with the cache described above."""

    def __init__(
        self,
        factory: sessionmaker[Session],
        *,
        ttl_s: float = 5.0,
        max_entries: int = 10_000,
        max_stale_s: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._factory = factory
        self._ttl_s = ttl_s
        self._max_entries = max_entries
        self._max_stale_s = max_stale_s
        self._clock = clock
        self._cache: OrderedDict[str, _Entry] = OrderedDict()

    def authenticate(self, authorization: str | None) -> KeyIdentity:
        """Identity for the header's key (blocking: may query the database)."""
        token = bearer_token(authorization)
        digest = keys.hash_key(token)
        now = self._clock()
        entry = self._cache.get(digest)
        if entry is None or now >= entry.expires_at:
            entry = self._refresh(token, digest, entry, now)
        if entry.identity is None:
            raise AuthError("invalid or revoked API key")
        return entry.identity

    def _refresh(self, token: str, digest: str, old: _Entry | None, now: float) -> _Entry:
        try:
            with self._factory() as session:
                identity = resolve_key(session, token)
        except Exception as exc:  # database down: serve the last known answer
            if old is not None and now < old.stale_until:
                log.warning("auth: key store unavailable, using cached answer (%s)", exc)
                return old
            raise AuthError(
                "the key store is unavailable; retry shortly", code="service_unavailable",
                status=503,
            ) from exc
        entry = _Entry(identity, now + self._ttl_s, now + self._max_stale_s)
        self._cache[digest] = entry
        self._cache.move_to_end(digest)
        while len(self._cache) > self._max_entries:
            self._cache.popitem(last=False)
        return entry

    def cached(self, authorization: str | None) -> KeyIdentity | None:
        """A fresh cached identity without touching the database (fast path), else None.

        The format check is skipped: only keys that passed it are ever cached, and a
        malformed key's digest is therefore never found (it falls through to
        :meth:`authenticate`, which refuses it)."""
        scheme, _, token = (authorization or "").strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return None
        entry = self._cache.get(keys.hash_key(token))
        if entry is None or self._clock() >= entry.expires_at:
            return None
        return entry.identity
