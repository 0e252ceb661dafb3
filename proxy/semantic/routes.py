"""HTTP routes of the semantic cache; the proxy app includes these routers.

* ``DELETE /v1/cache/entries/{id}``      delete one of the caller's entries (another
                                           tenant's id is a 404, like a missing one)
* ``POST /v1/cache/feedback``            ``{"entry_id" | "request_id", "feedback": "wrong"}``
                                           a wrong observation for the error bound (at the
                                           score the hit was served at: by request id),
                                           then invalidates the entry that answered; a
                                           malformed id (not ``sem_`` + 32 hex digits, not
                                           a UUID) is a 400
* ``DELETE /admin/tenants/{name}/cache`` flush one tenant (admin dependency)

Errors use OpenAI's shape. A store outage on these write paths is a 503.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from proxy.semantic.service import SemanticCache

TenantIdOf = Callable[[Any], "str | int"]
ENTRY_ID_RE = re.compile(r"sem_[0-9a-f]{32}")
REQUEST_ID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
ResolveTenant = Callable[[str], "Awaitable[str | int | None] | str | int | None"]


def openai_error(
    status: int, message: str, *, type_: str, code: str, param: str | None = None
) -> JSONResponse:
    """A JSON error in OpenAI's shape."""
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(status_code=status, content=body)


def _default_tenant_id(identity: Any) -> str | int:
    """``identity.tenant_id`` (e.g. billing's KeyIdentity), or the value itself."""
    if isinstance(identity, str | int):
        return identity
    tenant_id: str | int = identity.tenant_id
    return tenant_id


def _unavailable() -> JSONResponse:
    return openai_error(503, "the cache store is unavailable, try again", type_="server_error",
                        code="cache_unavailable")  # fmt: skip


def build_cache_router(
    cache: SemanticCache,
    tenant_dependency: Callable[..., Any],
    tenant_id_of: TenantIdOf = _default_tenant_id,
) -> APIRouter:
    """Tenant-scoped cache routes; ``tenant_dependency`` authenticates the API key."""
    router = APIRouter(tags=["cache"])

    @router.delete("/v1/cache/entries/{entry_id}")
    async def delete_entry(
        entry_id: str, identity: Any = Depends(tenant_dependency)
    ) -> JSONResponse:
        try:
            deleted = await cache.delete(tenant_id_of(identity), entry_id)
        except Exception:
            return _unavailable()
        if not deleted:
            return openai_error(404, f"no cache entry {entry_id!r}", type_="invalid_request_error",
                                code="cache_entry_not_found", param="entry_id")  # fmt: skip
        return JSONResponse({"id": entry_id, "object": "cache.entry.deleted", "deleted": True})

    @router.post("/v1/cache/feedback")
    async def feedback(
        request: Request, identity: Any = Depends(tenant_dependency)
    ) -> JSONResponse:
        parsed = await _parse_feedback(request)
        if isinstance(parsed, JSONResponse):
            return parsed
        entry_id, request_id = parsed
        try:
            invalidated = await cache.invalidate(
                tenant_id_of(identity), entry_id=entry_id, request_id=request_id
            )
        except Exception:
            return _unavailable()
        if invalidated is None:
            return openai_error(404, "no cache entry matches this feedback",
                                type_="invalid_request_error", code="cache_entry_not_found",
                                param="entry_id" if entry_id else "request_id")  # fmt: skip
        return JSONResponse({"object": "cache.feedback", "invalidated": invalidated})

    return router


async def _parse_feedback(request: Request) -> tuple[str | None, str | None] | JSONResponse:
    def bad(message: str, param: str | None) -> JSONResponse:
        return openai_error(400, message, type_="invalid_request_error",
                            code="invalid_feedback", param=param)  # fmt: skip

    try:
        body = await request.json()
    except ValueError:
        return bad("body must be a JSON object", None)
    if not isinstance(body, dict):
        return bad("body must be a JSON object", None)
    entry_id, request_id = body.get("entry_id"), body.get("request_id")
    for name, value, form, what in (
        ("entry_id", entry_id, ENTRY_ID_RE, "sem_ and 32 hex digits"),
        ("request_id", request_id, REQUEST_ID_RE, "a UUID (x-kvtoll-request-id)"),
    ):
        if value is not None and (not isinstance(value, str) or not form.fullmatch(value)):
            return bad(f"{name} must be {what}", name)
    if entry_id is None and request_id is None:
        return bad("give entry_id or request_id", "entry_id")
    if body.get("feedback") != "wrong":
        return bad('feedback must be "wrong"', "feedback")
    return entry_id, request_id


def build_admin_cache_router(
    cache: SemanticCache,
    admin_dependency: Callable[..., Any],
    resolve_tenant: ResolveTenant,
) -> APIRouter:
    """``DELETE /admin/tenants/{name}/cache``; ``resolve_tenant(name)`` gives the tenant
    id (sync or async), or None when there is no such tenant (404)."""
    router = APIRouter(tags=["admin"], dependencies=[Depends(admin_dependency)])

    @router.delete("/admin/tenants/{name}/cache")
    async def flush_tenant(name: str) -> JSONResponse:
        tenant_id = resolve_tenant(name)
        if inspect.isawaitable(tenant_id):
            tenant_id = await tenant_id
        if tenant_id is None:
            return openai_error(404, f"no tenant {name!r}", type_="invalid_request_error",
                                code="tenant_not_found", param="name")  # fmt: skip
        try:
            flushed = await cache.flush(tenant_id)
        except Exception:
            return _unavailable()
        return JSONResponse({"object": "cache.flush", "tenant": name, "flushed": flushed})

    return router
