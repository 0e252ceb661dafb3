"""Hourly usage rollup (``usage_hourly``), backfilled from the ledger.

The usage and costs views read this table instead of the ledger; from now on
:func:`billing.ledger.write_usage_many` keeps it in the ledger insert's
transaction. The backfill is one ``INSERT ... SELECT ... GROUP BY`` over the
ledger with the UTC hour truncated per dialect (written out here, frozen, rather
than imported: a migration must not change when the application code does). On
PostgreSQL the ledger is locked against writers (``SHARE`` mode) until the
migration commits, so no row can be written between the backfill and the switch.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_HOUR = {
    "postgresql": "date_trunc('hour', created_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'",
    "sqlite": "strftime('%Y-%m-%d %H:00:00.000000', created_at)",
}
_BACKFILL = (
    "INSERT INTO usage_hourly (tenant_id, hour, model, api_key_id, served_by, num_requests,"
    " prompt_tokens, cached_tokens, completion_tokens, billed_pico, list_pico)"
    " SELECT tenant_id, {hour}, model, COALESCE(api_key_id, ''), served_by, COUNT(*),"
    " SUM(prompt_tokens), SUM(cached_tokens), SUM(completion_tokens), SUM(billed_pico),"
    " SUM(list_pico) FROM usage_ledger GROUP BY 1, 2, 3, 4, 5"
)


def upgrade() -> None:
    op.create_table(
        "usage_hourly",
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("hour", sa.DateTime(timezone=True), nullable=False),
        sa.Column("model", sa.String(length=128), nullable=False),
        sa.Column("api_key_id", sa.String(length=32), nullable=False),
        sa.Column(
            "served_by",
            sa.Enum("semantic", "engine", name="servedby", native_enum=False, length=16),
            nullable=False,
        ),
        sa.Column("num_requests", sa.BigInteger(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cached_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column("billed_pico", sa.BigInteger(), nullable=False),
        sa.Column("list_pico", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_usage_hourly_tenant_id_tenants")
        ),
        sa.PrimaryKeyConstraint(
            "tenant_id", "hour", "model", "api_key_id", "served_by", name=op.f("pk_usage_hourly")
        ),
    )
    op.create_index("ix_usage_hourly_hour", "usage_hourly", ["hour"], unique=False)
    dialect = op.get_context().dialect.name
    if dialect not in _HOUR:
        raise RuntimeError(f"no hour truncation for database dialect {dialect!r}")
    if dialect == "postgresql":
        op.execute("LOCK TABLE usage_ledger IN SHARE MODE")
    op.execute(_BACKFILL.format(hour=_HOUR[dialect]))


def downgrade() -> None:
    op.drop_index("ix_usage_hourly_hour", table_name="usage_hourly")
    op.drop_table("usage_hourly")
