"""Tenant names case-insensitively unique: a unique index on ``lower(name)``.

Before this revision ``acme`` and ``ACME`` could both exist. The upgrade refuses,
changing nothing, while such names exist, and lists every clash so the operator can
rename or merge them first (tenant names are ASCII, so ``lower`` folds them the same
way on SQLite and PostgreSQL).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from alembic.util import CommandError

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

INDEX = "uq_tenants_name_lower"


class TenantNameClash(CommandError):
    """Tenant names that differ only in case; the migration cannot proceed (``kvtoll db
    upgrade`` prints it as one ``error:`` line and exits 2)."""


def clashing_names(connection: sa.Connection) -> list[list[str]]:
    """Groups of tenant names equal but for case, each sorted."""
    rows = connection.execute(sa.text(
        "SELECT name FROM tenants WHERE lower(name) IN ("
        "SELECT lower(name) FROM tenants GROUP BY lower(name) HAVING COUNT(*) > 1)"
    )).scalars()
    groups: dict[str, list[str]] = {}
    for name in rows:
        groups.setdefault(name.lower(), []).append(name)
    return [sorted(group) for _, group in sorted(groups.items())]


def upgrade() -> None:
    if op.get_context().as_sql:  # offline: nothing to check against
        op.create_index(INDEX, "tenants", [sa.text("lower(name)")], unique=True)
        return
    clashes = clashing_names(op.get_bind())
    if clashes:
        listed = "; ".join(", ".join(group) for group in clashes)
        raise TenantNameClash(
            f"tenant names must be unique ignoring case, but these clash: {listed}. "
            "Rename all but one of each group, then run the upgrade again."
        )
    op.create_index(INDEX, "tenants", [sa.text("lower(name)")], unique=True)


def downgrade() -> None:
    op.drop_index(INDEX, table_name="tenants")
