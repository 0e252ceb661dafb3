"""Who is calling: a tenant (API key or session cookie) or the operator (admin token).

Tenant API calls send ``Authorization: Bearer kvt_...``; pages use the session
cookie set at sign-in (HttpOnly, SameSite=Strict, signed, expiring, never the key).
Every cookie request re-checks that the key behind the session is still unrevoked.
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
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from billing.accounts import KeyIdentity, resolve_key
from billing.models import ApiKey, Tenant, TenantId
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
    """Set a session cookie: HttpOnly, SameSite=Strict, Secure on HTTPS."""
    response.set_cookie(
        name, value, max_age=SESSION_TTL_S, path=path, httponly=True, samesite="strict",
        secure=request.url.scheme == "https",
    )


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
        claims = {"tid": int(principal.tenant_id), "kid": principal.key_id}
        return principal, self.signer.issue(claims, time.time())

    def from_cookie(self, request: Request) -> TenantPrincipal | None:
        """The principal of a valid session cookie whose key is still unrevoked."""
        claims = self.signer.verify(request.cookies.get(TENANT_COOKIE), time.time())
        if claims is None:
            return None
        query = (
            select(ApiKey.tenant_id, Tenant.name)
            .join(Tenant, Tenant.id == ApiKey.tenant_id)
            .where(ApiKey.id == str(claims.get("kid")), ApiKey.revoked_at.is_(None))
        )
        with self._factory() as session:
            found = session.execute(query).first()
        if found is None or found[0] != claims.get("tid"):
            return None
        return TenantPrincipal(TenantId(found[0]), found[1], str(claims["kid"]))

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

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
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
        return self.signer.verify(request.cookies.get(ADMIN_COOKIE), time.time()) is not None

    def require(self, request: Request) -> None:
        """Refuse unless the caller is the operator."""
        self.check_enabled()
        if not self.is_signed_in(request):
            raise unauthorized("admin token required")

    def new_session(self) -> str:
        return self.signer.issue({"role": "admin"}, time.time())
