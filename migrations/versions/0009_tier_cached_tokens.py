"""Which KV tier served a request's cached tokens (issue 28 item 5).

``usage_ledger`` gains ``tier_host_cached_tokens`` and ``tier_shared_cached_tokens``
(nullable: NULL when the worker has no KV tier or did not say, as for every row
written before this revision); ``usage_hourly`` gains their sums (0 for existing
rows, which had none). Additive: nothing is rewritten.

Revision ID: 0009
Revises: 0005
Create Date: 2026-12-04
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_LAYERS = ("tier_host_cached_tokens", "tier_shared_cached_tokens")


def upgrade() -> None:
    with op.batch_alter_table("usage_ledger") as batch:
        for name in _LAYERS:
            batch.add_column(sa.Column(name, sa.Integer(), nullable=True))
    with op.batch_alter_table("usage_hourly") as batch:
        for name in _LAYERS:
            batch.add_column(
                sa.Column(name, sa.BigInteger(), nullable=False, server_default="0")
            )


def downgrade() -> None:
    with op.batch_alter_table("usage_hourly") as batch:
        for name in reversed(_LAYERS):
            batch.drop_column(name)
    with op.batch_alter_table("usage_ledger") as batch:
        for name in reversed(_LAYERS):
            batch.drop_column(name)
