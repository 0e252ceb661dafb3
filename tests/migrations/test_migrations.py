from __future__ import annotations

import multiprocessing
from multiprocessing.synchronize import Event
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from billing.db import make_engine
from billing.migrate import (
    alembic_config,
    current_revision,
    downgrade,
    head_revision,
    is_up_to_date,
    upgrade,
)
from billing.models import Base
from migrations.location import script_location

TABLES = {
    "tenants", "api_keys", "prices", "usage_ledger", "usage_hourly", "invoices", "invoice_lines"
}


def _tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def _schema_diff(url: str) -> list[object]:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            return list(compare_metadata(context, Base.metadata))
    finally:
        engine.dispose()


def test_upgrade_downgrade_upgrade_round_trip(db_url: str) -> None:
    assert current_revision(db_url) is None
    upgrade(db_url)
    assert _tables(db_url) == TABLES
    assert is_up_to_date(db_url)
    downgrade(db_url)
    assert _tables(db_url) == set()
    assert current_revision(db_url) is None
    upgrade(db_url, "head")
    assert _tables(db_url) == TABLES
    assert current_revision(db_url) == head_revision()


def test_migrated_schema_matches_the_models(db_url: str) -> None:
    upgrade(db_url)
    assert _schema_diff(db_url) == []


def test_env_reads_the_url_from_kvtoll_settings(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVTOLL_DATABASE_URL", sqlite_url)
    config = Config()
    config.set_main_option("script_location", str(script_location()))
    command.upgrade(config, "head")
    assert _tables(sqlite_url) == TABLES


def test_offline_mode_renders_sql_without_a_database(capsys: pytest.CaptureFixture[str]) -> None:
    command.upgrade(alembic_config("postgresql+psycopg://nobody@invalid/none"), "head", sql=True)
    sql = capsys.readouterr().out
    assert "CREATE TABLE usage_ledger" in sql
    assert "uq_usage_ledger_request_id" in sql


def _replica_upgrade(url: str, start: Event) -> None:
    start.wait(30)
    upgrade(url)


def test_concurrent_upgrades_on_postgres_serialise(postgres_url: str) -> None:
    """Replicas that all migrate at start-up (processes: Alembic's context is global)."""
    context = multiprocessing.get_context("fork")
    start = context.Event()
    replicas = [
        context.Process(target=_replica_upgrade, args=(postgres_url, start)) for _ in range(3)
    ]
    for replica in replicas:
        replica.start()
    start.set()
    for replica in replicas:
        replica.join(120)
    assert [replica.exitcode for replica in replicas] == [0, 0, 0]
    assert _tables(postgres_url) == TABLES and is_up_to_date(postgres_url)


def test_autogenerate_finds_nothing_new_and_the_template_renders(
    sqlite_url: str, tmp_path: Path
) -> None:
    upgrade(sqlite_url)
    config = alembic_config(sqlite_url)
    config.set_main_option(
        "version_locations", f"{script_location() / 'versions'} {tmp_path}"
    )
    script = command.revision(
        config, message="probe", autogenerate=True, rev_id="probe", version_path=str(tmp_path)
    )
    assert script is not None and not isinstance(script, list)
    source = Path(script.path).read_text()
    compile(source, script.path, "exec")
    assert "down_revision: str | None = '0002'" in source
    upgrade_body = source.split("def upgrade() -> None:")[1].split("def downgrade")[0]
    statements = [line.strip() for line in upgrade_body.splitlines() if line.strip()]
    assert [line for line in statements if not line.startswith("#")] == ["pass"]
