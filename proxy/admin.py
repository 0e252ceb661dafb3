"""Admin API under ``/admin`` (bearer admin token), mirroring the CLI.

::

    GET  /admin/tenants                      kvtoll tenant list
    POST /admin/tenants        {name}        kvtoll tenant create NAME
    GET  /admin/tenants/{name}/policy        (the semantic-cache policy)
    PATCH /admin/tenants/{name}/policy {semantic_max_error_rate}
                                             kvtoll tenant policy NAME --semantic-max-error-rate D
    GET  /admin/tenants/{name}/keys          kvtoll key list TENANT
    POST /admin/tenants/{name}/keys          kvtoll key create TENANT [--name --rpm --tpm]
    POST /admin/keys/{key_id}/revoke         kvtoll key revoke KEY_ID
    GET  /admin/prices[?model=]              kvtoll price list [--model]
    POST /admin/prices                       kvtoll price set MODEL --input ...
    GET  /admin/budgets[?tenant=]            kvtoll budget list [--tenant]
    POST /admin/budgets  {tenant, key_id?, monthly_usd, alert_at?}
                                             kvtoll budget set TENANT [--key] --monthly-usd
    DELETE /admin/budgets/{tenant}[?key_id=] kvtoll budget remove TENANT [--key]

Prices and budgets travel as decimal *strings* (USD per 1M tokens), never floats. Billing errors
map to 404 (not found), 409 (conflict) and 400 (invalid input), in OpenAI's shape.
The plaintext of a new key appears once, in the creation response.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, Strict

from billing import accounts, budgets, pricing
from billing.accounts import MAX_LIMIT
from billing.budgets import BudgetRow, BudgetStatus
from billing.errors import BillingError, Conflict, NotFound
from billing.models import ApiKey, Price, Tenant
from billing.money import exact_usd, ppm_to_fraction, price_per_1m_usd
from kvtoll.openai.errors import INVALID_REQUEST, error_body
from proxy.deps import AdminDep, SessionDep

router = APIRouter(prefix="/admin", dependencies=[AdminDep])
DecimalText = Annotated[str, Strict(), Field(min_length=1, max_length=32)]
PositiveInt = Annotated[int, Strict(), Field(ge=1, le=MAX_LIMIT)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TenantIn(_Body):
    name: Annotated[str, Strict()]


class PolicyIn(_Body):
    semantic_max_error_rate: Annotated[float, Strict(), Field(gt=0.0, lt=1.0)]


class KeyIn(_Body):
    name: Annotated[str, Strict()] | None = None
    requests_per_minute: PositiveInt | None = None
    tokens_per_minute: PositiveInt | None = None


class PriceIn(_Body):
    model: Annotated[str, Strict()]
    input: DecimalText
    cached_input: DecimalText
    output: DecimalText
    semantic_fraction: DecimalText
    effective_from: datetime | None = None


class BudgetIn(_Body):
    tenant: Annotated[str, Strict()]
    key_id: Annotated[str, Strict()] | None = None
    monthly_usd: DecimalText
    alert_at: DecimalText | None = None


def _budget(b: BudgetRow) -> dict[str, Any]:
    return {
        "tenant": b.tenant_name, "key_id": b.api_key_id,
        "monthly_usd": exact_usd(b.terms.limit_pico), "alert_at": str(b.alert_at),
        "updated_at": b.updated_at.isoformat(),
    }


def _budget_status(s: BudgetStatus) -> dict[str, Any]:
    return {
        **_budget(s.budget), "period": s.period, "spent_usd": exact_usd(s.spent_pico),
        "percent_used": s.budget.terms.percent_used(s.spent_pico), "state": s.state,
    }


def _tenant(t: Tenant) -> dict[str, Any]:
    return {"id": t.id, "name": t.name, "created_at": t.created_at.isoformat()}


def _key(k: ApiKey) -> dict[str, Any]:
    return {
        "key_id": k.id, "prefix": k.display_prefix, "name": k.name,
        "created_at": k.created_at.isoformat(),
        "revoked_at": k.revoked_at.isoformat() if k.revoked_at else None,
        "requests_per_minute": k.requests_per_minute, "tokens_per_minute": k.tokens_per_minute,
    }


def _price(p: Price) -> dict[str, Any]:
    return {
        "model": p.model,
        "input": str(price_per_1m_usd(p.input_pico)),
        "cached_input": str(price_per_1m_usd(p.cached_input_pico)),
        "output": str(price_per_1m_usd(p.output_pico)),
        "semantic_fraction": str(ppm_to_fraction(p.semantic_hit_ppm)),
        "effective_from": p.effective_from.isoformat(),
    }


@router.get("/tenants")
def list_tenants(session: SessionDep) -> dict[str, Any]:
    return {"data": [_tenant(t) for t in accounts.list_tenants(session)]}


@router.post("/tenants", status_code=201)
def create_tenant(body: TenantIn, session: SessionDep) -> dict[str, Any]:
    return _tenant(accounts.create_tenant(session, body.name))


def _policy(t: Tenant) -> dict[str, Any]:
    return {"name": t.name, "semantic_threshold": t.semantic_threshold,
            "semantic_allow_sampled": t.semantic_allow_sampled,
            "semantic_max_error_rate": t.semantic_max_error_rate}  # fmt: skip


@router.get("/tenants/{name}/policy")
def get_policy(name: str, session: SessionDep) -> dict[str, Any]:
    return _policy(accounts.require_tenant(session, name))


@router.patch("/tenants/{name}/policy")
def set_policy(name: str, body: PolicyIn, session: SessionDep) -> dict[str, Any]:
    t = accounts.require_tenant(session, name)
    accounts.set_tenant_policy(
        session, name, semantic_threshold=t.semantic_threshold,
        semantic_allow_sampled=t.semantic_allow_sampled, kv_reserved_blocks=t.kv_reserved_blocks,
        kv_max_blocks=t.kv_max_blocks, semantic_max_entries=t.semantic_max_entries,
        semantic_max_bytes=t.semantic_max_bytes,
        semantic_max_error_rate=body.semantic_max_error_rate,
    )  # fmt: skip
    return _policy(t)


@router.get("/tenants/{name}/keys")
def list_keys(name: str, session: SessionDep) -> dict[str, Any]:
    return {"data": [_key(k) for k in accounts.list_keys(session, name)]}


@router.post("/tenants/{name}/keys", status_code=201)
def create_key(name: str, body: KeyIn, session: SessionDep) -> dict[str, Any]:
    """Create a key; ``key`` (the plaintext) is shown only in this response."""
    row, plaintext = accounts.create_key(
        session, name, body.name, requests_per_minute=body.requests_per_minute,
        tokens_per_minute=body.tokens_per_minute,
    )
    return {**_key(row), "key": plaintext}


@router.post("/keys/{key_id}/revoke")
def revoke_key(key_id: str, session: SessionDep) -> dict[str, Any]:
    return _key(accounts.revoke_key(session, key_id))


@router.get("/prices")
def list_prices(session: SessionDep, model: str | None = None) -> dict[str, Any]:
    return {"data": [_price(p) for p in pricing.list_prices(session, model)]}


@router.post("/prices", status_code=201)
def set_price(body: PriceIn, session: SessionDep) -> dict[str, Any]:
    return _price(
        pricing.set_price(
            session, body.model, body.input, body.cached_input, body.output,
            body.semantic_fraction, body.effective_from,
        )
    )


@router.get("/budgets")
def list_budgets(session: SessionDep, tenant: str | None = None) -> dict[str, Any]:
    """Budgets with this month's spend from the ledger."""
    tenant_id = None if tenant is None else accounts.require_tenant(session, tenant).id
    return {"data": [_budget_status(s) for s in budgets.budget_statuses(session, tenant_id)]}


@router.post("/budgets", status_code=201)
def set_budget(body: BudgetIn, session: SessionDep) -> dict[str, Any]:
    """Create or replace a budget; gateways apply it within their key-cache TTL."""
    return _budget(
        budgets.set_budget(session, body.tenant, body.key_id, body.monthly_usd, body.alert_at)
    )


@router.delete("/budgets/{tenant}", status_code=204)
def remove_budget(tenant: str, session: SessionDep, key_id: str | None = None) -> Response:
    budgets.remove_budget(session, tenant, key_id)
    return Response(status_code=204)


async def on_billing_error(request: Request, exc: Exception) -> JSONResponse:
    """404 / 409 / 400 for billing errors, in OpenAI's error shape."""
    assert isinstance(exc, BillingError)
    status, code = 400, "invalid_value"
    if isinstance(exc, NotFound):
        status, code = 404, "not_found"
    elif isinstance(exc, Conflict):
        status, code = 409, "conflict"
    return JSONResponse(error_body(str(exc), type=INVALID_REQUEST, code=code), status_code=status)
