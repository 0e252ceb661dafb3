"""``PUT /kv/shares``: the gateway's table of tenant KV shares, pushed to a worker on
a change and again every few seconds (:mod:`proxy.kv_policy_push`), so a tenant's
reservation holds from then on, not from its next request here.

Body: ``{"shares": [{"cache_salt": HEX, "tenant": NAME, "reserved_blocks": N,
"max_blocks": M | null}, ...]}`` (the salt as in ``cache_salt``; the share as in
``kvtoll_kv_share``). Each entry is upserted; a share the pool cannot hold is listed
in ``refused`` and the others still apply. A malformed body is a 400 and nothing
applies.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.api import AcceptsKVShares, AsyncEngineClient, KVShare
from engine.kv.hashing import TenantSalt
from kvtoll.openai.errors import OpenAIError

MAX_SHARES = 100_000


class _Entry(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    cache_salt: str = Field(pattern=r"^(?:[0-9a-f]{2}){1,64}$")
    tenant: str = Field(min_length=1, max_length=128)
    reserved_blocks: int = Field(ge=0)
    max_blocks: int | None = Field(default=None, ge=0)


class _Table(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    shares: list[_Entry] = Field(max_length=MAX_SHARES)


def apply_shares(engine: AsyncEngineClient, body: object) -> dict[str, Any]:
    """Validate ``body`` and hand its shares to ``engine``: ``{"applied": n,
    "refused": [line, ...]}``. OpenAIError 400 on a malformed body, 501 for an engine
    that takes no pushed shares."""
    if not isinstance(engine, AcceptsKVShares):
        raise OpenAIError("this worker takes no pushed KV shares", status=501)
    try:
        table = _Table.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise OpenAIError(f"invalid kv shares: {where}: {first['msg']}", status=400,
                          param="shares") from None  # fmt: skip
    shares = [
        (TenantSalt(bytes.fromhex(e.cache_salt)),
         KVShare(e.tenant, e.reserved_blocks, e.max_blocks))
        for e in table.shares
    ]  # fmt: skip
    refused = engine.set_kv_shares(shares)
    return {"applied": len(shares) - len(refused), "refused": refused}
