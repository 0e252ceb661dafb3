"""SQLAlchemy 2 typed models: tenants, API keys, prices, the usage ledger and its
hourly rollup, invoices, spend budgets.

Money is stored as integer picodollars (1e-12 USD) so that SQLite and PostgreSQL
add it up exactly; :mod:`billing.money` converts to and from ``Decimal``. Prices
are per 1M tokens; a price row takes effect at ``effective_from`` and is never
rewritten, so a ledger row always rates against the price in force at its time.
"""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import Any, NewType

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Dialect,
    Enum,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    UniqueConstraint,
    false,
    func,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

TenantId = NewType("TenantId", int)
ApiKeyId = NewType("ApiKeyId", str)
PriceId = NewType("PriceId", int)

DEFAULT_SEMANTIC_MAX_ERROR_RATE = 0.02  # tenants.semantic_max_error_rate's server default

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class UtcDateTime(TypeDecorator[datetime]):
    """An aware UTC ``datetime`` on every backend.

    PostgreSQL keeps ``timestamptz``; SQLite has no time zones, so values are
    converted to UTC on the way in and tagged UTC on the way out. Naive values are
    refused: a naive time in a ledger is a bug waiting to bill the wrong month.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError(f"naive datetime {value!r}: pass an aware (UTC) datetime")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


def _enum_column(enum_cls: type[enum.StrEnum], length: int) -> Enum:
    """A portable VARCHAR enum storing the member *values* (no native PG type)."""
    return Enum(
        enum_cls, native_enum=False, length=length, values_callable=lambda e: [m.value for m in e]
    )


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class ServedBy(enum.StrEnum):
    SEMANTIC = "semantic"
    ENGINE = "engine"


class RequestStatus(enum.StrEnum):
    OK = "ok"
    UPSTREAM_ERROR = "upstream_error"
    CLIENT_DISCONNECT = "client_disconnect"


class InvoiceStatus(enum.StrEnum):
    CLOSED = "closed"


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime())
    # Per-tenant cache policy (NULL = server default).
    semantic_threshold: Mapped[float | None] = mapped_column(Float, nullable=True)
    semantic_allow_sampled: Mapped[bool] = mapped_column(Boolean, default=False)
    kv_reserved_blocks: Mapped[int] = mapped_column(Integer, default=0)
    kv_max_blocks: Mapped[int | None] = mapped_column(Integer, nullable=True)  # NULL: no cap
    semantic_max_entries: Mapped[int | None] = mapped_column(Integer, nullable=True)
    semantic_max_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # The semantic cache's error bound, in (0, 1) (proxy/semantic/bound.py).
    semantic_max_error_rate: Mapped[float] = mapped_column(Float, server_default="0.02")

    keys: Mapped[list[ApiKey]] = relationship(back_populates="tenant")


# Tenant names are case-insensitively unique: "acme" and "ACME" cannot both exist.
Index("uq_tenants_name_lower", func.lower(Tenant.name), unique=True)


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)  # "key_" + random
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), index=True)
    key_hash: Mapped[str] = mapped_column(String(128), unique=True)
    display_prefix: Mapped[str] = mapped_column(String(32))
    name: Mapped[str | None] = mapped_column(String(128), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime())
    revoked_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), nullable=True)
    # Per-key rate limits (NULL = server default).
    requests_per_minute: Mapped[int | None] = mapped_column(Integer, nullable=True)
    tokens_per_minute: Mapped[int | None] = mapped_column(Integer, nullable=True)

    tenant: Mapped[Tenant] = relationship(back_populates="keys")


class WebSession(Base):
    """A dashboard sign-in (tenant or operator): the cookie carries its id, this table
    its hash and whether it still holds; logout ends it, and a tenant session ends with
    its key's revocation (see :mod:`billing.sessions`)."""

    __tablename__ = "web_sessions"
    __table_args__ = (Index("ix_web_sessions_expires_at", "expires_at"),)

    id_hash: Mapped[str] = mapped_column(String(64), primary_key=True)  # sha256 hex of the id
    kind: Mapped[str] = mapped_column(String(16))  # "tenant" | "admin"
    tenant_id: Mapped[int | None] = mapped_column(ForeignKey("tenants.id"), nullable=True)
    api_key_id: Mapped[str | None] = mapped_column(ForeignKey("api_keys.id"), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime())
    expires_at: Mapped[datetime] = mapped_column(UtcDateTime())
    ended_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), nullable=True)


class Price(Base):
    __tablename__ = "prices"
    __table_args__ = (
        UniqueConstraint("model", "effective_from"),
        CheckConstraint(
            "input_pico >= 0 AND cached_input_pico >= 0 AND output_pico >= 0",
            name="non_negative",
        ),
        CheckConstraint("semantic_hit_ppm BETWEEN 0 AND 1000000", name="fraction_ppm"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    model: Mapped[str] = mapped_column(String(128), index=True)
    # Picodollars per token == microdollars per 1M tokens.
    input_pico: Mapped[int] = mapped_column(BigInteger)
    cached_input_pico: Mapped[int] = mapped_column(BigInteger)
    output_pico: Mapped[int] = mapped_column(BigInteger)
    # Parts per million of the uncached price billed for a semantic hit.
    semantic_hit_ppm: Mapped[int] = mapped_column(Integer)
    effective_from: Mapped[datetime] = mapped_column(UtcDateTime())
    created_at: Mapped[datetime] = mapped_column(UtcDateTime())


class UsageRecord(Base):
    """One row per accepted request, written exactly once (unique ``request_id``)."""

    __tablename__ = "usage_ledger"
    __table_args__ = (
        Index("ix_usage_ledger_tenant_created", "tenant_id", "created_at"),
        Index("ix_usage_ledger_invoice", "invoice_id"),
        CheckConstraint(
            "prompt_tokens >= 0 AND completion_tokens >= 0 AND cached_tokens >= 0"
            " AND cached_tokens <= prompt_tokens",
            name="tokens",
        ),
        CheckConstraint("billed_pico >= 0 AND list_pico >= 0", name="amounts"),
    )

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    request_id: Mapped[str] = mapped_column(String(36), unique=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"))
    api_key_id: Mapped[str | None] = mapped_column(ForeignKey("api_keys.id"), nullable=True)
    model: Mapped[str] = mapped_column(String(128))
    served_by: Mapped[ServedBy] = mapped_column(_enum_column(ServedBy, 16))
    status: Mapped[RequestStatus] = mapped_column(_enum_column(RequestStatus, 32))
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    cached_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    similarity: Mapped[float | None] = mapped_column(Float, nullable=True)
    worker: Mapped[str | None] = mapped_column(String(256), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime())  # request arrival
    recorded_at: Mapped[datetime] = mapped_column(UtcDateTime())  # row written
    latency_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    ttft_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    # the stream was cut (gateway crash, worker failure mid-stream): billed what it had
    # delivered by then (proxy.progress)
    cut: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # Of cached_tokens, those a worker's KV tier loaded: its host tier / the shared
    # store (NULL: no tier, or not reported).
    tier_host_cached_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    tier_shared_cached_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    price_id: Mapped[int | None] = mapped_column(ForeignKey("prices.id"), nullable=True)
    billed_pico: Mapped[int] = mapped_column(BigInteger)
    list_pico: Mapped[int] = mapped_column(BigInteger)
    invoice_id: Mapped[int | None] = mapped_column(ForeignKey("invoices.id"), nullable=True)


NO_API_KEY = ""  # api_key_id of requests made without a key, in the rollup's key


class UsageHourly(Base):
    """Ledger sums per UTC hour and group, kept in the ledger insert's transaction.

    One row per ``(tenant_id, hour, model, api_key_id, served_by)``; a request
    without a key counts under :data:`NO_API_KEY` (a key column cannot be NULL:
    NULLs never conflict in a unique index). See :mod:`billing.usage_rollup`.
    """

    __tablename__ = "usage_hourly"
    __table_args__ = (Index("ix_usage_hourly_hour", "hour"),)

    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), primary_key=True)
    hour: Mapped[datetime] = mapped_column(UtcDateTime(), primary_key=True)
    model: Mapped[str] = mapped_column(String(128), primary_key=True)
    api_key_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    served_by: Mapped[ServedBy] = mapped_column(_enum_column(ServedBy, 16), primary_key=True)
    num_requests: Mapped[int] = mapped_column(BigInteger)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    cached_tokens: Mapped[int] = mapped_column(BigInteger)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)
    billed_pico: Mapped[int] = mapped_column(BigInteger)
    list_pico: Mapped[int] = mapped_column(BigInteger)
    tier_host_cached_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")
    tier_shared_cached_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")


class Invoice(Base):
    __tablename__ = "invoices"
    __table_args__ = (UniqueConstraint("tenant_id", "period"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"))
    period: Mapped[str] = mapped_column(String(7))  # "YYYY-MM"
    status: Mapped[InvoiceStatus] = mapped_column(_enum_column(InvoiceStatus, 16))
    total_pico: Mapped[int] = mapped_column(BigInteger)
    list_pico: Mapped[int] = mapped_column(BigInteger)
    closed_at: Mapped[datetime] = mapped_column(UtcDateTime())

    lines: Mapped[list[InvoiceLine]] = relationship(
        back_populates="invoice", order_by="InvoiceLine.id"
    )


class InvoiceLine(Base):
    __tablename__ = "invoice_lines"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    invoice_id: Mapped[int] = mapped_column(ForeignKey("invoices.id"), index=True)
    model: Mapped[str] = mapped_column(String(128))
    kind: Mapped[str] = mapped_column(String(32))  # uncached_input|cached_input|semantic_hit|output
    quantity: Mapped[int] = mapped_column(BigInteger)  # tokens
    unit_pico: Mapped[int] = mapped_column(BigInteger)  # per token; 0 when mixed prices
    amount_pico: Mapped[int] = mapped_column(BigInteger)
    list_pico: Mapped[int] = mapped_column(BigInteger)

    invoice: Mapped[Invoice] = relationship(back_populates="lines")


class Budget(Base):
    """A monthly spend budget of a tenant (``api_key_id`` :data:`NO_API_KEY`) or of one of
    its keys: a hard limit in picodollars per UTC month and a soft alert threshold in
    parts per million of it. See :mod:`billing.budgets`."""

    __tablename__ = "budgets"
    __table_args__ = (
        CheckConstraint("monthly_limit_pico >= 0", name="limit_non_negative"),
        CheckConstraint("alert_ppm BETWEEN 1 AND 1000000", name="alert_ppm"),
    )

    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), primary_key=True)
    api_key_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    monthly_limit_pico: Mapped[int] = mapped_column(BigInteger)
    alert_ppm: Mapped[int] = mapped_column(Integer)
    updated_at: Mapped[datetime] = mapped_column(UtcDateTime())
