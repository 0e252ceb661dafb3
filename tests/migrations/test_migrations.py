from __future__ import annotations

import multiprocessing
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.util import CommandError
from sqlalchemy import column, func, insert, inspect, select, table, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from sqlalchemy.sql.expression import TableClause

from billing.db import make_engine, session_factory
from billing.ledger import LedgerEntry, write_usage
from billing.migrate import (
    alembic_config,
    current_revision,
    downgrade,
    head_revision,
    is_up_to_date,
    script_location,
    upgrade,
)
from billing.models import (
    ApiKey,
    Base,
    RequestStatus,
    ServedBy,
    Tenant,
    TenantId,
    UsageHourly,
    UsageRecord,
)

TABLES = {
    "tenants", "api_keys", "prices", "usage_ledger", "usage_hourly", "invoices", "invoice_lines",
    "budgets",
    "web_sessions",
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
    assert f"down_revision: str | None = '{head_revision()}'" in source
    upgrade_body = source.split("def upgrade() -> None:")[1].split("def downgrade")[0]
    statements = [line.strip() for line in upgrade_body.splitlines() if line.strip()]
    assert [line for line in statements if not line.startswith("#")] == ["pass"]


def _old_ledger(url: str) -> list[dict[str, Any]]:
    """A ledger written before 0002 (plain inserts: no rollup existed)."""
    when = [
        datetime(2026, 3, 9, 23, 59, 59, 999_999, tzinfo=UTC), datetime(2026, 3, 10, tzinfo=UTC),
        datetime(2026, 3, 10, 0, 30, tzinfo=UTC), datetime(2026, 3, 10, 5, 29, tzinfo=UTC),
    ]
    now = datetime.now(UTC)
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.execute(insert(Tenant).values(id=1, name="old", created_at=now,
                                                     semantic_allow_sampled=False,
                                                     kv_reserved_blocks=0))
        conn.execute(insert(ApiKey).values(id="key_old", tenant_id=1, key_hash="h",
                                                     display_prefix="p", created_at=now))
        rows = [
            {"request_id": str(uuid.uuid4()), "tenant_id": 1, "model": "m",
             "api_key_id": "key_old" if i % 2 else None,
             "served_by": ServedBy.SEMANTIC if i == 2 else ServedBy.ENGINE,
             "status": RequestStatus.OK, "prompt_tokens": 10 + i, "cached_tokens": i,
             "completion_tokens": 3, "created_at": at, "recorded_at": now,
             "billed_pico": 100 * i, "list_pico": 200 * i}
            for i, at in enumerate(when)
        ]
        conn.execute(insert(_ledger_at_0001()), rows)
    engine.dispose()
    return rows


def _ledger_at_0001() -> TableClause:
    """``usage_ledger`` with only the columns it had at 0001 (later ones, like 0008's
    ``cut``, do not exist yet), typed as the model types them."""
    later = {"cut"}
    return table("usage_ledger", *(column(c.name, c.type) for c in UsageRecord.__table__.c
                                   if c.name not in later))


def _hourly(url: str) -> dict[tuple[object, ...], tuple[int, ...]]:
    engine = make_engine(url)
    try:
        with Session(engine) as session:
            return {
                (h.hour, h.api_key_id, ServedBy(h.served_by)): (
                    h.num_requests, h.prompt_tokens, h.cached_tokens, h.completion_tokens,
                    h.billed_pico, h.list_pico)
                for h in session.scalars(select(UsageHourly))
            }
    finally:
        engine.dispose()


def test_0002_backfills_the_rollup_in_utc_and_writes_continue_it(db_url: str) -> None:
    if db_url.startswith("postgresql"):  # a session time zone 5:30 from UTC must not matter
        engine = make_engine(db_url)
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            name = engine.url.database
            conn.execute(text(f"ALTER DATABASE \"{name}\" SET timezone TO 'Asia/Kolkata'"))
        engine.dispose()
    upgrade(db_url, "0001")
    rows = _old_ledger(db_url)
    upgrade(db_url)
    day = datetime(2026, 3, 10, tzinfo=UTC)
    assert _hourly(db_url) == {
        (day - timedelta(hours=1), "", ServedBy.ENGINE): (1, 10, 0, 3, 0, 0),
        (day, "key_old", ServedBy.ENGINE): (1, 11, 1, 3, 100, 200),
        (day, "", ServedBy.SEMANTIC): (1, 12, 2, 3, 200, 400),
        (day + timedelta(hours=5), "key_old", ServedBy.ENGINE): (1, 13, 3, 3, 300, 600),
    }
    engine = make_engine(db_url)
    late = LedgerEntry(
        request_id=str(uuid.uuid4()), tenant_id=TenantId(1), api_key_id=None, model="m",
        served_by=ServedBy.ENGINE, status=RequestStatus.OK, prompt_tokens=5, cached_tokens=0,
        completion_tokens=1, similarity=None, worker=None,
        created_at=day - timedelta(minutes=1),
    )
    assert write_usage(session_factory(engine), late)
    engine.dispose()
    grown = _hourly(db_url)
    assert len(grown) == 4  # the same rollup row as the backfill's, not a second one
    assert grown[(day - timedelta(hours=1), "", ServedBy.ENGINE)] == (2, 15, 0, 4, 0, 0)
    downgrade(db_url, "0001")
    assert _tables(db_url) == TABLES - {"usage_hourly", "budgets", "web_sessions"}
    engine = make_engine(db_url)
    with engine.connect() as conn:
        count = conn.execute(select(func.count()).select_from(UsageRecord)).scalar()
    engine.dispose()
    assert count == len(rows) + 1


def test_the_models_name_the_newest_migration() -> None:
    from billing.migrate import head_revision
    from billing.schema import SCHEMA_REVISION

    assert head_revision() == SCHEMA_REVISION


def test_schema_problem_reads_the_revision(tmp_path: Path) -> None:
    from billing.db import make_engine
    from billing.migrate import downgrade, upgrade
    from billing.schema import schema_problem

    url = f"sqlite:///{tmp_path / 'k.db'}"
    engine = make_engine(url)
    assert "does not exist yet" in (schema_problem(url, engine) or "")
    upgrade(url)
    assert schema_problem(url, engine) is None
    downgrade(url, "0001")
    assert "schema is at 0001" in (schema_problem(url, engine) or "")
    engine.dispose()


def _tenant_rows(url: str, names: Sequence[str]) -> None:
    engine = make_engine(url)
    with engine.begin() as conn:
        for name in names:
            conn.execute(insert(Tenant).values(name=name, created_at=datetime.now(UTC),
                                               semantic_allow_sampled=False,
                                               kv_reserved_blocks=0))
    engine.dispose()


def test_0003_refuses_names_that_clash_in_case_and_lists_them(db_url: str) -> None:
    upgrade(db_url, "0002")
    _tenant_rows(db_url, ["acme", "ACME", "Beta", "beta", "gamma"])
    with pytest.raises(CommandError) as refused:
        upgrade(db_url)
    message = str(refused.value)
    assert "ACME, acme" in message and "Beta, beta" in message and "gamma" not in message
    assert current_revision(db_url) == "0002"  # nothing changed
    engine = make_engine(db_url)
    with engine.begin() as conn:
        conn.execute(text("UPDATE tenants SET name = 'acme-2' WHERE name = 'ACME'"))
        conn.execute(text("DELETE FROM tenants WHERE name = 'Beta'"))
    engine.dispose()
    upgrade(db_url)
    assert is_up_to_date(db_url)
    with pytest.raises(IntegrityError):
        _tenant_rows(db_url, ["GAMMA"])


def test_0008_marks_existing_rows_not_cut_and_downgrades(db_url: str) -> None:
    upgrade(db_url, "0001")
    rows = _old_ledger(db_url)
    upgrade(db_url, "0008")
    engine = make_engine(db_url)
    with engine.connect() as conn:
        cut = conn.execute(select(UsageRecord.cut)).scalars().all()
    engine.dispose()
    assert cut == [False] * len(rows)
    downgrade(db_url, "0005")
    engine = make_engine(db_url)
    columns = {c["name"] for c in inspect(engine).get_columns("usage_ledger")}
    engine.dispose()
    assert "cut" not in columns and "billed_pico" in columns
