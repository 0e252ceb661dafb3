"""Tenants and API keys (services: no web framework, no commit).

Each function works inside the caller's transaction: it flushes so that errors
surface here, and the caller commits (``with factory.begin() as session: ...``).
Caller mistakes raise :class:`~billing.errors.BillingError` subclasses. A plaintext
key exists only in :func:`create_key`'s return value and in
:func:`resolve_key`'s argument; it is never stored or logged.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from billing import keys
from billing.errors import Conflict, InvalidInput, NotFound
from billing.models import DEFAULT_SEMANTIC_MAX_ERROR_RATE, ApiKey, ApiKeyId, Tenant, TenantId

log = logging.getLogger(__name__)

TENANT_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
MAX_LIMIT = 2**31 - 1  # rate-limit and reservation columns are 32-bit integers
MAX_KEY_NAME_LENGTH = 128


@dataclass(frozen=True)
class KeyIdentity:
    """Who a valid, unrevoked key belongs to, and the policy that comes with it."""

    key_id: ApiKeyId
    tenant_id: TenantId
    tenant_name: str
    requests_per_minute: int | None
    tokens_per_minute: int | None
    semantic_threshold: float | None
    semantic_allow_sampled: bool
    kv_reserved_blocks: int
    kv_max_blocks: int | None = None
    semantic_max_entries: int | None = None
    semantic_max_bytes: int | None = None
    semantic_max_error_rate: float = DEFAULT_SEMANTIC_MAX_ERROR_RATE


def check_tenant_name(name: str) -> str:
    """Return ``name`` if valid (1-64 of ``A-Za-z0-9._-``, starting alphanumeric)."""
    if not isinstance(name, str) or not TENANT_NAME_RE.fullmatch(name):
        raise InvalidInput(
            f"invalid tenant name {name!r}: use 1-64 letters, digits, '.', '_' or '-'"
        )
    return name


def create_tenant(session: Session, name: str) -> Tenant:
    """Create a tenant; :class:`Conflict` if the name is taken, in any case."""
    check_tenant_name(name)
    existing = get_tenant_by_name(session, name)
    if existing is not None:
        same = "" if existing.name == name else f" (as {existing.name!r}: names ignore case)"
        raise Conflict(f"tenant {name!r} already exists{same}")
    tenant = Tenant(
        name=name, created_at=datetime.now(UTC), semantic_allow_sampled=False, kv_reserved_blocks=0,
        semantic_max_error_rate=DEFAULT_SEMANTIC_MAX_ERROR_RATE,
    )
    session.add(tenant)
    try:
        session.flush()
    except IntegrityError as exc:
        raise Conflict(f"tenant {name!r} already exists") from exc
    log.info("tenant created", extra={"tenant_id": tenant.id, "tenant": name})
    return tenant


def list_tenants(session: Session) -> Sequence[Tenant]:
    """All tenants by name."""
    return session.scalars(select(Tenant).order_by(Tenant.name)).all()


def get_tenant_by_name(session: Session, name: str) -> Tenant | None:
    """The tenant called ``name`` in any case (names are case-insensitively unique), or
    ``None`` (also for a name no tenant could have, which PostgreSQL might otherwise
    refuse, e.g. one holding a NUL)."""
    if not TENANT_NAME_RE.fullmatch(name):
        return None
    query = select(Tenant).where(func.lower(Tenant.name) == name.lower())
    return session.scalars(query).first()


def require_tenant(session: Session, name: str) -> Tenant:
    """The tenant called ``name``; :class:`NotFound` otherwise."""
    tenant = get_tenant_by_name(session, name)
    if tenant is None:
        raise NotFound(f"unknown tenant {name!r}")
    return tenant


@dataclass(frozen=True)
class TenantKVPolicy:
    """One tenant's share of each worker's KV cache, as the gateway pushes it."""

    tenant_id: TenantId
    name: str
    kv_reserved_blocks: int
    kv_max_blocks: int | None


def kv_policies(session: Session) -> list[TenantKVPolicy]:
    """Every tenant whose KV share is not the default (nothing reserved, no cap), by id."""
    query = (
        select(Tenant.id, Tenant.name, Tenant.kv_reserved_blocks, Tenant.kv_max_blocks)
        .where((Tenant.kv_reserved_blocks > 0) | Tenant.kv_max_blocks.is_not(None))
        .order_by(Tenant.id)
    )
    return [
        TenantKVPolicy(TenantId(row.id), row.name, row.kv_reserved_blocks, row.kv_max_blocks)
        for row in session.execute(query)
    ]


def set_tenant_policy(
    session: Session,
    name: str,
    *,
    semantic_threshold: float | None,
    semantic_allow_sampled: bool,
    kv_reserved_blocks: int,
    kv_max_blocks: int | None = None,
    semantic_max_entries: int | None = None,
    semantic_max_bytes: int | None = None,
    semantic_max_error_rate: float | None = None,
) -> Tenant:
    """Replace a tenant's cache policy (threshold ``None`` = server default; KV cap
    ``None`` = none; error bound ``None`` = keep the tenant's)."""
    tenant = require_tenant(session, name)
    if semantic_threshold is not None and not 0.0 <= semantic_threshold <= 1.0:
        raise InvalidInput(f"semantic threshold must be in [0, 1], got {semantic_threshold}")
    rate = tenant.semantic_max_error_rate
    if semantic_max_error_rate is not None:
        rate = check_max_error_rate(semantic_max_error_rate)
    _check_kv_blocks(kv_reserved_blocks, kv_max_blocks)
    tenant.semantic_threshold = semantic_threshold
    tenant.semantic_allow_sampled = bool(semantic_allow_sampled)
    tenant.kv_reserved_blocks = kv_reserved_blocks
    tenant.kv_max_blocks = kv_max_blocks
    tenant.semantic_max_entries = _check_capacity(semantic_max_entries, "semantic_max_entries")
    tenant.semantic_max_bytes = _check_capacity(semantic_max_bytes, "semantic_max_bytes", 2**62)
    tenant.semantic_max_error_rate = rate
    session.flush()
    log.info("tenant policy set", extra={"tenant": name})
    return tenant


def check_max_error_rate(value: float) -> float:
    """``value`` if it is a rate strictly between 0 and 1 (the error bound)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 < value < 1.0:
        raise InvalidInput(f"semantic_max_error_rate must be in (0, 1), got {value!r}")
    return float(value)


def _check_kv_blocks(reserved: int, cap: int | None) -> None:
    """A KV share every worker could be asked for: counts in 0..MAX_LIMIT, cap >= reserved
    (a worker refuses a reservation larger than its own pool, naming it)."""
    if isinstance(reserved, bool) or not 0 <= reserved <= MAX_LIMIT:
        raise InvalidInput(f"kv_reserved_blocks must be in 0..{MAX_LIMIT}, got {reserved}")
    if cap is None:
        return
    if isinstance(cap, bool) or not 0 <= cap <= MAX_LIMIT:
        raise InvalidInput(f"kv_max_blocks must be in 0..{MAX_LIMIT}, got {cap}")
    if cap < reserved:
        raise InvalidInput(
            f"kv_max_blocks ({cap}) must be at least kv_reserved_blocks ({reserved})"
        )


def _check_capacity(value: int | None, what: str, top: int = MAX_LIMIT) -> int | None:
    if value is not None and (isinstance(value, bool) or not 0 < value <= top):
        raise InvalidInput(f"{what} must be a positive integer up to {top} or unset")
    return value


def _check_limit(value: int | None, what: str) -> int | None:
    if value is not None and (isinstance(value, bool) or not 0 < value <= MAX_LIMIT):
        raise InvalidInput(f"{what} must be a positive integer up to {MAX_LIMIT} or unset")
    return value


def create_key(
    session: Session,
    tenant_name: str,
    name: str | None = None,
    *,
    requests_per_minute: int | None = None,
    tokens_per_minute: int | None = None,
) -> tuple[ApiKey, str]:
    """Create a key for ``tenant_name``; returns the row and the plaintext (show it once)."""
    tenant = require_tenant(session, tenant_name)
    if name is not None and (len(name) > MAX_KEY_NAME_LENGTH or not name.isprintable()):
        raise InvalidInput(f"key name must be at most {MAX_KEY_NAME_LENGTH} printable characters")
    plaintext = keys.generate_key()
    row = ApiKey(
        id=keys.generate_key_id(),
        tenant_id=tenant.id,
        key_hash=keys.hash_key(plaintext),
        display_prefix=keys.display_prefix(plaintext),
        name=name,
        created_at=datetime.now(UTC),
        requests_per_minute=_check_limit(requests_per_minute, "requests_per_minute"),
        tokens_per_minute=_check_limit(tokens_per_minute, "tokens_per_minute"),
    )
    session.add(row)
    session.flush()
    log.info("api key created", extra={"key_id": row.id, "tenant": tenant.name})
    return row, plaintext


def list_keys(session: Session, tenant_name: str) -> Sequence[ApiKey]:
    """The tenant's keys (revoked ones included), oldest first."""
    tenant = require_tenant(session, tenant_name)
    query = select(ApiKey).where(ApiKey.tenant_id == tenant.id)
    return session.scalars(query.order_by(ApiKey.created_at, ApiKey.id)).all()


def revoke_key(session: Session, key_id: str) -> ApiKey:
    """Revoke a key now; :class:`InvalidInput`/:class:`NotFound`/:class:`Conflict` if
    the id is malformed, unknown or already revoked."""
    if not keys.check_key_id(key_id):
        raise InvalidInput(f"malformed key id {key_id!r} (expected key_ + 20 characters)")
    row = session.get(ApiKey, key_id, with_for_update=True)
    if row is None:
        raise NotFound(f"unknown key id {key_id!r}")
    if row.revoked_at is not None:
        raise Conflict(f"key {key_id} was already revoked at {row.revoked_at.isoformat()}")
    row.revoked_at = datetime.now(UTC)
    session.flush()
    log.info("api key revoked", extra={"key_id": key_id})
    return row


def resolve_key(session: Session, plaintext: str) -> KeyIdentity | None:
    """The identity of a presented key, or ``None`` if malformed, unknown or revoked.

    A malformed key (typo, bad checksum) is refused without any database query;
    the stored hash is compared in constant time.
    """
    if not keys.check_format(plaintext):
        return None
    digest = keys.hash_key(plaintext)
    query = (
        select(ApiKey, Tenant)
        .join(Tenant, ApiKey.tenant_id == Tenant.id)
        .where(ApiKey.key_hash == digest)
    )
    found = session.execute(query).first()
    if found is None:
        return None
    key, tenant = found.tuple()
    if not keys.verify_hash(plaintext, key.key_hash) or key.revoked_at is not None:
        return None
    return KeyIdentity(
        key_id=ApiKeyId(key.id),
        tenant_id=TenantId(tenant.id),
        tenant_name=tenant.name,
        requests_per_minute=key.requests_per_minute,
        tokens_per_minute=key.tokens_per_minute,
        semantic_threshold=tenant.semantic_threshold,
        semantic_allow_sampled=tenant.semantic_allow_sampled,
        kv_reserved_blocks=tenant.kv_reserved_blocks,
        kv_max_blocks=tenant.kv_max_blocks,
        semantic_max_entries=tenant.semantic_max_entries,
        semantic_max_bytes=tenant.semantic_max_bytes,
        semantic_max_error_rate=tenant.semantic_max_error_rate,
    )
