"""Which schema this code needs, and whether a database has it, without Alembic.

:data:`SCHEMA_REVISION` names the migration the models in :mod:`billing.models`
match; ``tests/migrations`` holds it equal to the newest script, so a new migration
must bump it. Reading the ``alembic_version`` row is one query: the CLI and the
gateway check it before they touch billing data, and only ``kvtoll db`` loads
Alembic itself.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError, ProgrammingError

SCHEMA_REVISION = "0010"


def sqlite_file_missing(url: str) -> bool:
    """True for a SQLite URL whose database file does not exist (yet)."""
    parsed = make_url(url)
    database = parsed.database or ""
    return (
        parsed.get_backend_name() == "sqlite"
        and database not in ("", ":memory:")
        and not Path(database).exists()
    )


def schema_revision(engine: Engine) -> str | None:
    """The revision the database is at (``None``: never migrated)."""
    with engine.connect() as conn:
        try:
            return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
        except (OperationalError, ProgrammingError):  # no alembic_version table
            return None


def schema_problem(url: str, engine: Engine) -> str | None:
    """Why billing data at ``url`` cannot be used by this code, or ``None``."""
    if sqlite_file_missing(url):
        return "database does not exist yet: run `kvtoll db upgrade` first"
    current = schema_revision(engine)
    if current != SCHEMA_REVISION:
        return f"database schema is at {current or 'nothing'}: run `kvtoll db upgrade` first"
    return None
