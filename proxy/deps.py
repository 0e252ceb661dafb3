"""FastAPI dependency aliases (``Annotated``) used by the thin routes.

Cheap dependencies are ``async def``: FastAPI runs a plain ``def`` dependency in a
worker thread, which costs a thread hop per request on the hot path.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Header, Request
from sqlalchemy.orm import Session

from billing.accounts import KeyIdentity
from billing.models import TenantId
from kvtoll.openai.errors import INVALID_REQUEST, OpenAIError
from kvtoll.settings import Settings
from proxy.state import ProxyState


async def get_state(request: Request) -> ProxyState:
    state: ProxyState = request.app.state.kvtoll
    return state


StateDep = Annotated[ProxyState, Depends(get_state)]


async def get_settings(state: StateDep) -> Settings:
    return state.settings


SettingsDep = Annotated[Settings, Depends(get_settings)]


def get_session(state: StateDep) -> Iterator[Session]:
    """A session in a transaction committed when the route returns (rolled back on error)."""
    with state.session_factory.begin() as session:
        yield session


# scope="function": committed before the response is sent, so a client that reads
# right after a write sees it.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]


async def get_key(
    state: StateDep, authorization: Annotated[str | None, Header()] = None
) -> KeyIdentity:
    """The caller's key identity (401 in OpenAI's shape otherwise)."""
    return await state.intake.authenticate(authorization)


KeyDep = Annotated[KeyIdentity, Depends(get_key)]


async def get_tenant_id(identity: KeyDep) -> TenantId:
    """The caller's tenant, derived from its key (never from the request body)."""
    return identity.tenant_id


TenantDep = Annotated[TenantId, Depends(get_tenant_id)]


def require_admin(
    state: StateDep, authorization: Annotated[str | None, Header()] = None
) -> None:
    """Admin token check (:meth:`Settings.admin_disabled_reason`, then a constant-time
    compare), answered as the web admin routes answer it: 503 while disabled, else 401."""
    reason = state.settings.admin_disabled_reason()
    if reason is not None:
        raise OpenAIError(
            f"admin interface disabled: {reason}", status=503,
            type=INVALID_REQUEST, code="admin_disabled",
        )
    scheme, _, token = (authorization or "").partition(" ")
    presented = token.strip() if scheme.lower() == "bearer" else ""
    if not state.settings.admin_token_matches(presented):
        raise OpenAIError(
            "invalid admin token", status=401, type=INVALID_REQUEST, code="invalid_admin_token"
        )


AdminDep = Depends(require_admin)
