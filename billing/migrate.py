"""Drive Alembic programmatically: no ``alembic.ini`` needed.

The script location is the ``migrations`` package's directory, looked up by name
(it works from a checkout and from an installed wheel): Alembic loads those scripts,
which import billing's models; billing itself never imports them. The URL is handed
to ``migrations/env.py`` through ``Config.attributes``, which avoids configparser's
``%`` interpolation in passwords.
"""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from billing.db import make_engine


def script_location() -> Path:
    """The directory holding ``env.py`` and ``versions/`` (the ``migrations`` package)."""
    spec = find_spec("migrations")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the migrations package is not installed beside billing")
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def alembic_config(url: str) -> Config:
    """An Alembic config pointing at kvtoll's migrations and at ``url``."""
    config = Config()
    config.set_main_option("script_location", str(script_location()))
    config.attributes["url"] = url
    return config


def upgrade(url: str, revision: str = "head") -> None:
    """Migrate the database at ``url`` up to ``revision`` (default: latest)."""
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    """Migrate the database at ``url`` down to ``revision`` (default: drop everything)."""
    command.downgrade(alembic_config(url), revision)


def head_revision() -> str | None:
    """The newest revision shipped with this code."""
    return ScriptDirectory.from_config(alembic_config("")).get_current_head()


def current_revision(url: str) -> str | None:
    """The revision the database at ``url`` is at (``None`` = never migrated)."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def is_up_to_date(url: str) -> bool:
    """True if the database at ``url`` is at the head revision."""
    return current_revision(url) == head_revision()
