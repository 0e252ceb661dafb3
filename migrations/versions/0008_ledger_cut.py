"""Ledger rows of cut streams (``usage_ledger.cut``).

A stream cut short (the gateway killed mid-stream, a worker failing after the first
token) is billed what it had delivered (``proxy.progress``) and its row says so.
Additive: existing rows are not cut.

Revision ID: 0008
Revises: 0005
Create Date: 2026-12-04
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("usage_ledger", sa.Column("cut", sa.Boolean(), nullable=False,
                                            server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("usage_ledger") as batch:
        batch.drop_column("cut")
