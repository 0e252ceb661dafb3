"""Alembic environment for kvtoll.

The database comes, in order, from: a connection passed programmatically in
``config.attributes["connection"]``, a URL in ``config.attributes["url"]``
(see :mod:`billing.migrate`), ``sqlalchemy.url`` in an ini file, or the kvtoll
settings (``KVTOLL_DATABASE_URL``). SQLite runs in batch mode so that later
migrations can alter tables. On PostgreSQL the upgrade holds a transaction-level
advisory lock, so replicas that all migrate at start-up do it one after another
(the later ones find the schema at head and do nothing).
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, text

from billing.db import make_engine
from billing.models import Base

target_metadata = Base.metadata
MIGRATION_LOCK_KEY = 0x6B76746F6C6C  # "kvtoll"


def _database_url() -> str:
    config = context.config
    url = config.attributes.get("url") or config.get_main_option("sqlalchemy.url")
    if url:
        return str(url)
    from kvtoll.settings import load_settings

    return load_settings().database_url


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )


def run_migrations_offline() -> None:
    url = _database_url()
    context.configure(
        url=url,
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=url.startswith("sqlite"),
    )
    with context.begin_transaction():
        context.run_migrations()


def _run_locked(connection: Connection) -> None:
    _configure(connection)
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            connection.execute(
                text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY}
            )
        context.run_migrations()


def run_migrations_online() -> None:
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _run_locked(connection)
        return
    engine = make_engine(_database_url())
    try:
        with engine.connect() as conn:
            _run_locked(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
