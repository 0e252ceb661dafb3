"""Per-tenant cache capacity: a cap on KV blocks and the semantic cache's size.

``tenants.kv_max_blocks``: the most prefix-cache blocks the tenant may hold on one
worker (NULL = no cap; ``kv_reserved_blocks`` already exists). ``semantic_max_entries``
and ``semantic_max_bytes``: the tenant's semantic-cache capacity (NULL = the server's
default). Additive: every column is nullable, so existing rows keep their behaviour.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-04
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = ("kv_max_blocks", "semantic_max_entries", "semantic_max_bytes")


def upgrade() -> None:
    # Plain ADD/DROP COLUMN (SQLite >= 3.35 has both): a batch copy of the table would
    # lose the expression index on lower(name) that SQLAlchemy cannot reflect.
    op.add_column("tenants", sa.Column("kv_max_blocks", sa.Integer(), nullable=True))
    op.add_column("tenants", sa.Column("semantic_max_entries", sa.Integer(), nullable=True))
    op.add_column("tenants", sa.Column("semantic_max_bytes", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    for name in reversed(COLUMNS):
        op.drop_column("tenants", name)
