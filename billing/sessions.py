"""Server-side dashboard sessions (services: no web framework, no commit).

A sign-in makes a random session id; the signed cookie carries it, the table keeps
only its sha256 (a database reader cannot take over a session). A session holds
while its row exists, has not ended and has not expired; a tenant session also only
while its API key is unrevoked, checked in the same query, so revoking the key ends
it at once. Logout ends it. Expired rows are deleted at each sign-in.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from billing.models import ApiKey, ApiKeyId, Tenant, TenantId, WebSession

TENANT_SESSION = "tenant"
ADMIN_SESSION = "admin"


@dataclass(frozen=True)
class TenantSession:
    """The tenant and key behind a live tenant session."""

    tenant_id: TenantId
    tenant_name: str
    key_id: ApiKeyId


def _hash(session_id: str) -> str:
    return hashlib.sha256(session_id.encode()).hexdigest()


def start_session(
    session: Session,
    kind: str,
    ttl_s: int,
    *,
    tenant_id: int | None = None,
    key_id: str | None = None,
) -> str:
    """A new session of ``kind``; returns its id (goes into the signed cookie only)."""
    now = datetime.now(UTC)
    session.execute(delete(WebSession).where(WebSession.expires_at <= now))
    session_id = secrets.token_urlsafe(32)
    session.add(WebSession(id_hash=_hash(session_id), kind=kind, tenant_id=tenant_id,
                           api_key_id=key_id, created_at=now,
                           expires_at=now + timedelta(seconds=ttl_s)))
    session.flush()
    return session_id


def end_session(session: Session, session_id: str) -> bool:
    """Logout: the session stops holding; whether it was live."""
    result = session.execute(
        update(WebSession)
        .where(WebSession.id_hash == _hash(session_id), WebSession.ended_at.is_(None))
        .values(ended_at=datetime.now(UTC))
    )
    return bool(getattr(result, "rowcount", 0))


def admin_session_live(session: Session, session_id: str) -> bool:
    """Is this an operator session that has neither ended nor expired?"""
    query = select(WebSession.id_hash).where(
        WebSession.id_hash == _hash(session_id), WebSession.kind == ADMIN_SESSION,
        WebSession.ended_at.is_(None), WebSession.expires_at > datetime.now(UTC),
    )
    return session.execute(query).first() is not None


def live_tenant_session(session: Session, session_id: str) -> TenantSession | None:
    """The tenant of a live session whose key is unrevoked (one query), else ``None``."""
    query = (
        select(ApiKey.tenant_id, Tenant.name, ApiKey.id)
        .select_from(WebSession)
        .join(ApiKey, ApiKey.id == WebSession.api_key_id)
        .join(Tenant, Tenant.id == ApiKey.tenant_id)
        .where(
            WebSession.id_hash == _hash(session_id), WebSession.kind == TENANT_SESSION,
            WebSession.ended_at.is_(None), WebSession.expires_at > datetime.now(UTC),
            WebSession.tenant_id == ApiKey.tenant_id, ApiKey.revoked_at.is_(None),
        )
    )
    found = session.execute(query).first()
    if found is None:
        return None
    return TenantSession(TenantId(found[0]), found[1], ApiKeyId(found[2]))
