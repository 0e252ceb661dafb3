"""Who is calling: a tenant (API key or session cookie) or the operator (admin token).

Tenant API calls send ``Authorization: Bearer kvt_...``; pages use the session
cookie set at sign-in (HttpOnly, SameSite=Lax, Secure over https, signed, expiring,
never the key). The cookie carries a server-side session id
(:mod:`billing.sessions`): every cookie request checks that the session has not
ended (logout) and that the key behind it is still unrevoked, in one query.
The admin token is compared in constant time; admin routes refuse to work while
``Settings.admin_token_problem()`` reports a problem.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import Request, Response
from sqlalchemy.orm import Session, sessionmaker

from billing import sessions
from billing.accounts import KeyIdentity, resolve_key
from billing.models import TenantId
from kvtoll.settings import Settings
from web.errors import ApiError, unauthorized
from web.tokens import TokenSigner

TENANT_COOKIE = "kvtoll_session"
ADMIN_COOKIE = "kvtoll_admin"
SESSION_TTL_S = 8 * 3600
KeyResolver = Callable[[str], KeyIdentity | None]


@dataclass(frozen=True)
class TenantPrincipal:
    """The signed-in tenant and the key it signed in with."""

    tenant_id: TenantId
    tenant_name: str
    key_id: str


def session_secret(settings: Settings) -> bytes:
    """The server secret, or (none configured outside dev mode) a per-process random one.

    With a random secret, sessions do not survive a restart nor span replicas.
    """
    try:
        return settings.server_secret()
    except ValueError:
        return secrets.token_bytes(32)


def bearer_token(request: Request) -> str | None:
    """The token of an ``Authorization: Bearer`` header, if any."""
    header = request.headers.get("authorization")
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    return value.strip() if scheme.lower() == "bearer" else ""


def set_cookie(response: Response, request: Request, name: str, value: str, path: str) -> None:
    """Set a session cookie: HttpOnly, SameSite=Lax, Secure on HTTPS."""
    response.set_cookie(
        name, value, max_age=SESSION_TTL_S, path=path, httponly=True, samesite="lax",
        secure=request.url.scheme == "https",
    )


def clear_cookie(response: Response, request: Request, name: str, path: str) -> None:
    """Tell the browser to drop a session cookie (the session itself is ended server-side)."""
    response.delete_cookie(name, path=path, httponly=True, samesite="lax",
                           secure=request.url.scheme == "https")


def _session_id(signer: TokenSigner, token: str | None) -> str | None:
    claims = signer.verify(token, time.time())
    sid = claims.get("sid") if claims is not None else None
    return sid if isinstance(sid, str) and sid else None


def check_same_origin(request: Request) -> None:
    """Refuse a form POST whose ``Origin`` names another site (login CSRF)."""
    origin = request.headers.get("origin")
    if origin and origin != "null" and origin.rstrip("/") != str(request.base_url).rstrip("/"):
        raise ApiError(403, "cross-site form submission refused", code="forbidden")


def default_resolver(factory: sessionmaker[Session]) -> KeyResolver:
    """Resolve keys with :func:`billing.accounts.resolve_key` in a short session."""

    def resolve(plaintext: str) -> KeyIdentity | None:
        with factory() as session:
            return resolve_key(session, plaintext)

    return resolve


class TenantAuth:
    """Turns a request into a :class:`TenantPrincipal` (or refuses it)."""

    def __init__(
        self, factory: sessionmaker[Session], secret: bytes, resolver: KeyResolver | None = None
    ) -> None:
        self._factory = factory
        self._resolve = resolver or default_resolver(factory)
        self.signer = TokenSigner(secret, "tenant-session", SESSION_TTL_S)

    def sign_in(self, plaintext: str) -> tuple[TenantPrincipal, str] | None:
        """Check a key; on success the principal and a fresh session token."""
        identity = self._resolve(plaintext.strip())
        if identity is None:
            return None
        principal = TenantPrincipal(identity.tenant_id, identity.tenant_name, identity.key_id)
        with self._factory.begin() as session:
            sid = sessions.start_session(session, sessions.TENANT_SESSION, self.signer.ttl_s,
                                         tenant_id=principal.tenant_id, key_id=principal.key_id)
        return principal, self.signer.issue({"sid": sid}, time.time())

    def from_cookie(self, request: Request) -> TenantPrincipal | None:
        """The principal of a live session cookie whose key is still unrevoked."""
        sid = _session_id(self.signer, request.cookies.get(TENANT_COOKIE))
        if sid is None:
            return None
        with self._factory() as session:
            found = sessions.live_tenant_session(session, sid)
        if found is None:
            return None
        return TenantPrincipal(found.tenant_id, found.tenant_name, found.key_id)

    def sign_out(self, request: Request) -> None:
        """End the session of the request's cookie (logout), if it carries one."""
        sid = _session_id(self.signer, request.cookies.get(TENANT_COOKIE))
        if sid is not None:
            with self._factory.begin() as session:
                sessions.end_session(session, sid)

    def require(self, request: Request) -> TenantPrincipal:
        """Bearer key first (an invalid one is refused), then the session cookie."""
        token = bearer_token(request)
        if token is not None:
            identity = self._resolve(token) if token else None
            if identity is None:
                raise unauthorized()
            return TenantPrincipal(identity.tenant_id, identity.tenant_name, identity.key_id)
        principal = self.from_cookie(request)
        if principal is None:
            raise unauthorized("sign in or send Authorization: Bearer <API key>")
        return principal


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


class AdminAuth:
    """The operator: admin token (bearer or sign-in form) and the admin cookie."""

    def __init__(self, settings: Settings, factory: sessionmaker[Session]) -> None:
        self._settings = settings
        self._factory = factory
        self.problem = settings.admin_disabled_reason()
        self.dev_mode = settings.dev_mode
        self._token_digest = _digest(settings.admin_token.get_secret_value())
        secret = session_secret(settings)
        # Rotating the admin token invalidates every admin session.
        self.signer = TokenSigner(secret + self._token_digest, "admin-session", SESSION_TTL_S)

    def token_matches(self, candidate: str) -> bool:
        """Constant-time comparison with the configured admin token."""
        return self._settings.admin_token_matches(candidate)

    def check_enabled(self) -> None:
        if self.problem is not None:
            raise ApiError(503, f"admin interface disabled: {self.problem}", code="admin_disabled")

    def is_signed_in(self, request: Request) -> bool:
        """Admin cookie or bearer token valid."""
        if self.problem is not None:
            return False
        token = bearer_token(request)
        if token is not None:
            return bool(token) and self.token_matches(token)
        sid = _session_id(self.signer, request.cookies.get(ADMIN_COOKIE))
        if sid is None:
            return False
        with self._factory() as session:
            return sessions.admin_session_live(session, sid)

    def require(self, request: Request) -> None:
        """Refuse unless the caller is the operator."""
        self.check_enabled()
        if not self.is_signed_in(request):
            raise unauthorized("admin token required")

    def new_session(self) -> str:
        """A fresh operator session's cookie value."""
        with self._factory.begin() as session:
            sid = sessions.start_session(session, sessions.ADMIN_SESSION, self.signer.ttl_s)
        return self.signer.issue({"role": "admin", "sid": sid}, time.time())

    def sign_out(self, request: Request) -> None:
        """End the operator session of the request's cookie (logout), if any."""
        sid = _session_id(self.signer, request.cookies.get(ADMIN_COOKIE))
        if sid is not None:
            with self._factory.begin() as session:
                sessions.end_session(session, sid)
