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

On the request path (:meth:`KeyAuthenticator.resolve`) re-checks are single-flight
per key (concurrent requests share one lookup), each on a daemon thread of its own,
at most ``max_lookups`` at a time: a hanging database ties up those threads and
nothing else. An expired entry waits for its re-check at most ``revalidate_wait_s``;
past that (or once a lookup failed) the key store counts as failing and known keys
are answered from the cache at once (within ``max_stale_s``) while the re-check runs
in the background, until a lookup succeeds again. Only a key with no usable answer
waits for its lookup, at most ``wait_s``, then gets a 503 with ``Retry-After`` (at
once while ``max_lookups`` lookups hang). While the database answers, the revocation
bound stays ``ttl_s``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.orm import Session, sessionmaker

from billing import keys
from billing.accounts import KeyIdentity, resolve_key
from kvtoll.openai.errors import INVALID_REQUEST, SERVER_ERROR, OpenAIError
from proxy.threads import in_daemon_thread

log = logging.getLogger(__name__)


class AuthError(OpenAIError):
    """Refused credentials (401) or an identity store that cannot answer (503)."""

    def __init__(self, message: str, *, code: str = "invalid_api_key", status: int = 401) -> None:
        kind = INVALID_REQUEST if status < 500 else SERVER_ERROR
        super().__init__(message, status=status, type=kind, code=code)


def _store_unavailable() -> AuthError:
    return AuthError("the key store is unavailable; retry shortly", code="service_unavailable",
                     status=503)


@dataclass(frozen=True)
class _Entry:
    identity: KeyIdentity | None
    expires_at: float
    stale_until: float


def _answer(entry: _Entry) -> KeyIdentity:
    if entry.identity is None:
        raise AuthError("invalid or revoked API key")
    return entry.identity


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
        wait_s: float = 5.0,
        revalidate_wait_s: float = 0.2,
        max_lookups: int = 32,
    ) -> None:
        self._factory = factory
        self._ttl_s = ttl_s
        self._max_entries = max_entries
        self._max_stale_s = max_stale_s
        self._clock = clock
        self._wait_s = wait_s
        self._revalidate_wait_s = revalidate_wait_s
        self._cache: OrderedDict[str, _Entry] = OrderedDict()
        self._max_lookups = max_lookups
        self._inflight: dict[str, asyncio.Future[KeyIdentity | None]] = {}
        self._failing = False  # the last background lookup failed (logged once)

    async def resolve(self, authorization: str | None) -> KeyIdentity:
        """Identity for the header's key without waiting on the database for a key
        with a usable answer (see module doc)."""
        token = bearer_token(authorization)
        digest = keys.hash_key(token)
        now = self._clock()
        entry = self._cache.get(digest)
        if entry is not None and now < entry.stale_until:
            if now < entry.expires_at:
                return _answer(entry)
            return await self._revalidate(token, digest, entry)
        lookup = self._lookup_in_background(token, digest)
        if lookup is None:
            raise _store_unavailable()
        try:
            async with asyncio.timeout(self._wait_s):
                identity = await asyncio.shield(lookup)
        except TimeoutError:
            raise _store_unavailable() from None
        except Exception as exc:
            raise _store_unavailable() from exc
        if identity is None:
            raise AuthError("invalid or revoked API key")
        return identity

    async def _revalidate(self, token: str, digest: str, entry: _Entry) -> KeyIdentity:
        """A fresh answer for an expired ``entry``, or ``entry``'s if the store fails."""
        lookup = self._lookup_in_background(token, digest)
        if lookup is None or self._failing:
            return _answer(entry)
        try:
            async with asyncio.timeout(self._revalidate_wait_s):
                identity = await asyncio.shield(lookup)
        except TimeoutError:
            if not self._failing:
                log.warning("auth: key store slow (no answer in %g s), serving cached answers",
                            self._revalidate_wait_s)
            self._failing = True
            return _answer(entry)
        except Exception:
            return _answer(entry)
        if identity is None:
            raise AuthError("invalid or revoked API key")
        return identity

    def _lookup_in_background(
        self, token: str, digest: str
    ) -> asyncio.Future[KeyIdentity | None] | None:
        """The one lookup of ``digest`` in flight (started if none; None when
        ``max_lookups`` are running); its result lands in the cache, its failure keeps
        the old entry."""
        running = self._inflight.get(digest)
        if running is not None:
            return running
        if len(self._inflight) >= self._max_lookups:
            return None
        # the answer is as fresh as the moment the query started, not when it landed:
        # counting ttl_s from here keeps a policy change's reach within ttl_s
        started = self._clock()
        future = in_daemon_thread(lambda: self._lookup(token), "kvtoll-auth")
        self._inflight[digest] = future

        def landed(done: asyncio.Future[KeyIdentity | None]) -> None:
            self._inflight.pop(digest, None)
            if done.cancelled():
                return
            exc = done.exception()
            if exc is not None:
                if not self._failing:
                    log.warning("auth: key store unavailable, serving cached answers (%s)", exc)
                self._failing = True
                return
            if self._failing:
                log.info("auth: key store answers again")
            self._failing = False
            self._store(digest, done.result(), started)

        future.add_done_callback(landed)
        return future

    def _lookup(self, token: str) -> KeyIdentity | None:
        with self._factory() as session:
            return resolve_key(session, token)

    def _store(self, digest: str, identity: KeyIdentity | None, now: float) -> _Entry:
        entry = _Entry(identity, now + self._ttl_s, now + self._max_stale_s)
        self._cache[digest] = entry
        self._cache.move_to_end(digest)
        while len(self._cache) > self._max_entries:
            self._cache.popitem(last=False)
        return entry

    def close(self) -> None:
        """Abandon the lookups in flight (their threads end on their own)."""
        for future in list(self._inflight.values()):
            future.cancel()
        self._inflight.clear()

    def authenticate(self, authorization: str | None) -> KeyIdentity:
        """Identity for the header's key (blocking: may query the database)."""
        token = bearer_token(authorization)
        digest = keys.hash_key(token)
        now = self._clock()
        entry = self._cache.get(digest)
        if entry is None or now >= entry.expires_at:
            entry = self._refresh(token, digest, entry, now)
        return _answer(entry)

    def _refresh(self, token: str, digest: str, old: _Entry | None, now: float) -> _Entry:
        try:
            with self._factory() as session:
                identity = resolve_key(session, token)
        except Exception as exc:  # database down: serve the last known answer
            if old is not None and now < old.stale_until:
                log.warning("auth: key store unavailable, using cached answer (%s)", exc)
                return old
            raise _store_unavailable() from exc
        return self._store(digest, identity, now)

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
