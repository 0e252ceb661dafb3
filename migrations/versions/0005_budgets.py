"""Spend budgets (``budgets``): per tenant and per key, a monthly limit and an alert.

One row per tenant (``api_key_id`` = ``''``) or key: the hard limit in picodollars
per UTC month and the soft alert threshold in parts per million of it. Nothing is
backfilled: no budget exists before this revision.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "budgets",
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("api_key_id", sa.String(length=32), nullable=False),
        sa.Column("monthly_limit_pico", sa.BigInteger(), nullable=False),
        sa.Column("alert_ppm", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint(
            "monthly_limit_pico >= 0", name=op.f("ck_budgets_limit_non_negative")
        ),
        sa.CheckConstraint("alert_ppm BETWEEN 1 AND 1000000", name=op.f("ck_budgets_alert_ppm")),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_budgets_tenant_id_tenants")
        ),
        sa.PrimaryKeyConstraint("tenant_id", "api_key_id", name=op.f("pk_budgets")),
    )


def downgrade() -> None:
    op.drop_table("budgets")
