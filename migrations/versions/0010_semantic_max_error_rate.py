"""Per-tenant error bound of the semantic cache (issue 23 item 3).

``tenants.semantic_max_error_rate``: the largest wrong-hit rate the tenant accepts from
the semantic cache, in (0, 1); a hit is served only where the evidence's upper bound of
the entry's error at its score is within it (``proxy/semantic/bound.py``). Existing
rows get the default, 0.02. Plain ADD/DROP COLUMN, as 0006 (a batch copy of the table
would lose the expression index on lower(name)).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "tenants",
        sa.Column("semantic_max_error_rate", sa.Float(), nullable=False, server_default="0.02"),
    )


def downgrade() -> None:
    op.drop_column("tenants", "semantic_max_error_rate")
