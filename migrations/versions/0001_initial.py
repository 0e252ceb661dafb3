"""Initial schema: tenants, API keys, prices, the usage ledger, invoices.

Generated with ``alembic revision --autogenerate`` against PostgreSQL, then checked by
hand (``UtcDateTime`` rendered as its ``DateTime(timezone=True)`` impl) and by
tests/migrations, which assert that the upgraded schema matches ``billing.models``.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "prices",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("model", sa.String(length=128), nullable=False),
        sa.Column("input_pico", sa.BigInteger(), nullable=False),
        sa.Column("cached_input_pico", sa.BigInteger(), nullable=False),
        sa.Column("output_pico", sa.BigInteger(), nullable=False),
        sa.Column("semantic_hit_ppm", sa.Integer(), nullable=False),
        sa.Column("effective_from", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint(
            "input_pico >= 0 AND cached_input_pico >= 0 AND output_pico >= 0",
            name=op.f("ck_prices_non_negative"),
        ),
        sa.CheckConstraint(
            "semantic_hit_ppm BETWEEN 0 AND 1000000", name=op.f("ck_prices_fraction_ppm")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_prices")),
        sa.UniqueConstraint("model", "effective_from", name=op.f("uq_prices_model_effective_from")),
    )
    op.create_index(op.f("ix_prices_model"), "prices", ["model"], unique=False)
    op.create_table(
        "tenants",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("semantic_threshold", sa.Float(), nullable=True),
        sa.Column("semantic_allow_sampled", sa.Boolean(), nullable=False),
        sa.Column("kv_reserved_blocks", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tenants")),
        sa.UniqueConstraint("name", name=op.f("uq_tenants_name")),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("key_hash", sa.String(length=128), nullable=False),
        sa.Column("display_prefix", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("requests_per_minute", sa.Integer(), nullable=True),
        sa.Column("tokens_per_minute", sa.Integer(), nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_api_keys_tenant_id_tenants")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("key_hash", name=op.f("uq_api_keys_key_hash")),
    )
    op.create_index(op.f("ix_api_keys_tenant_id"), "api_keys", ["tenant_id"], unique=False)
    op.create_table(
        "invoices",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("period", sa.String(length=7), nullable=False),
        sa.Column(
            "status",
            sa.Enum("closed", name="invoicestatus", native_enum=False, length=16),
            nullable=False,
        ),
        sa.Column("total_pico", sa.BigInteger(), nullable=False),
        sa.Column("list_pico", sa.BigInteger(), nullable=False),
        sa.Column("closed_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_invoices_tenant_id_tenants")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_invoices")),
        sa.UniqueConstraint("tenant_id", "period", name=op.f("uq_invoices_tenant_id_period")),
    )
    op.create_table(
        "invoice_lines",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("invoice_id", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(length=128), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("quantity", sa.BigInteger(), nullable=False),
        sa.Column("unit_pico", sa.BigInteger(), nullable=False),
        sa.Column("amount_pico", sa.BigInteger(), nullable=False),
        sa.Column("list_pico", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["invoice_id"], ["invoices.id"], name=op.f("fk_invoice_lines_invoice_id_invoices")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_invoice_lines")),
    )
    op.create_index(
        op.f("ix_invoice_lines_invoice_id"), "invoice_lines", ["invoice_id"], unique=False
    )
    op.create_table(
        "usage_ledger",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("request_id", sa.String(length=36), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("api_key_id", sa.String(length=32), nullable=True),
        sa.Column("model", sa.String(length=128), nullable=False),
        sa.Column(
            "served_by",
            sa.Enum("semantic", "engine", name="servedby", native_enum=False, length=16),
            nullable=False,
        ),
        sa.Column(
            "status",
            sa.Enum(
                "ok",
                "upstream_error",
                "client_disconnect",
                name="requeststatus",
                native_enum=False,
                length=32,
            ),
            nullable=False,
        ),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("similarity", sa.Float(), nullable=True),
        sa.Column("worker", sa.String(length=256), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("latency_ms", sa.Float(), nullable=True),
        sa.Column("ttft_ms", sa.Float(), nullable=True),
        sa.Column("price_id", sa.Integer(), nullable=True),
        sa.Column("billed_pico", sa.BigInteger(), nullable=False),
        sa.Column("list_pico", sa.BigInteger(), nullable=False),
        sa.Column("invoice_id", sa.Integer(), nullable=True),
        sa.CheckConstraint(
            "billed_pico >= 0 AND list_pico >= 0", name=op.f("ck_usage_ledger_amounts")
        ),
        sa.CheckConstraint(
            "prompt_tokens >= 0 AND completion_tokens >= 0 AND cached_tokens >= 0"
            " AND cached_tokens <= prompt_tokens",
            name=op.f("ck_usage_ledger_tokens"),
        ),
        sa.ForeignKeyConstraint(
            ["api_key_id"], ["api_keys.id"], name=op.f("fk_usage_ledger_api_key_id_api_keys")
        ),
        sa.ForeignKeyConstraint(
            ["invoice_id"], ["invoices.id"], name=op.f("fk_usage_ledger_invoice_id_invoices")
        ),
        sa.ForeignKeyConstraint(
            ["price_id"], ["prices.id"], name=op.f("fk_usage_ledger_price_id_prices")
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_usage_ledger_tenant_id_tenants")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_usage_ledger")),
        sa.UniqueConstraint("request_id", name=op.f("uq_usage_ledger_request_id")),
    )
    op.create_index("ix_usage_ledger_invoice", "usage_ledger", ["invoice_id"], unique=False)
    op.create_index(
        "ix_usage_ledger_tenant_created", "usage_ledger", ["tenant_id", "created_at"], unique=False
    )


def downgrade() -> None:
    op.drop_index("ix_usage_ledger_tenant_created", table_name="usage_ledger")
    op.drop_index("ix_usage_ledger_invoice", table_name="usage_ledger")
    op.drop_table("usage_ledger")
    op.drop_index(op.f("ix_invoice_lines_invoice_id"), table_name="invoice_lines")
    op.drop_table("invoice_lines")
    op.drop_table("invoices")
    op.drop_index(op.f("ix_api_keys_tenant_id"), table_name="api_keys")
    op.drop_table("api_keys")
    op.drop_table("tenants")
    op.drop_index(op.f("ix_prices_model"), table_name="prices")
    op.drop_table("prices")
