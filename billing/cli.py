"""``kvtoll db|tenant|key|price|budget`` commands.

Settings are read when a command runs (``KVTOLL_DATABASE_URL``). Each command runs
in one transaction (:func:`billing.cli_support.transaction`): a caller's mistake
(unknown tenant, duplicate name, malformed or revoked key id, bad price or fraction)
prints one line, exits 2 and writes nothing. ``key create`` prints the plaintext key
once; it is never stored. ``price`` and ``budget`` live in :mod:`billing.cli_money`.
"""

from __future__ import annotations

from collections.abc import Callable

import typer
from sqlalchemy.exc import SQLAlchemyError

from billing import accounts
from billing.cli_money import budget_group, price_group
from billing.cli_support import (
    database_url,
    first_line,
    iso,
    number,
    pick,
    print_rows,
    transaction,
)
from billing.errors import BillingError
from billing.keys import REVOCATION_BOUND_S
from billing.schema import sqlite_file_missing
from kvtoll.cli.errors import fail

REVOKE_HELP = (f"Revoke a key: every gateway refuses it within {REVOCATION_BOUND_S} s (the "
               "lifetime of its key cache, while it reaches the database); dashboard "
               "sessions signed in with the key end at once.")


def _db_group() -> typer.Typer:
    group = typer.Typer(help="Database schema migrations.", no_args_is_help=True)

    @group.command("upgrade")
    def upgrade(revision: str = typer.Option("head", help="Target revision.")) -> None:
        """Create or migrate the schema (KVTOLL_DATABASE_URL) up to REVISION."""
        from billing import migrate

        _run_migration(migrate.upgrade, revision)
        typer.echo(f"database at {migrate.current_revision(database_url())}")

    @group.command("downgrade")
    def downgrade(
        revision: str = typer.Option("base", help="Target revision (base drops every table)."),
        yes: bool = typer.Option(False, "--yes", help="Confirm that data may be dropped."),
    ) -> None:
        """Migrate the schema down to REVISION (default: base, dropping all billing data)."""
        if not yes:
            fail("downgrade drops data: pass --yes to confirm")
        from billing import migrate

        _run_migration(migrate.downgrade, revision)
        typer.echo(f"database at {migrate.current_revision(database_url()) or 'base'}")

    @group.command("current")
    def current() -> None:
        """Print the schema revision of the database and the newest one available."""
        from billing import migrate

        url = database_url()
        try:
            revision = None if sqlite_file_missing(url) else migrate.current_revision(url)
        except BillingError as exc:
            fail(str(exc))
        except SQLAlchemyError as exc:
            fail(f"database error: {first_line(exc)}")
        typer.echo(f"current {revision or 'base'} head {migrate.head_revision()}")

    return group


def _run_migration(step: Callable[[str, str], None], revision: str) -> None:
    from alembic.util import CommandError

    try:
        step(database_url(), revision)
    except BillingError as exc:
        fail(str(exc))
    except CommandError as exc:
        fail(first_line(exc))
    except SQLAlchemyError as exc:
        fail(f"database error: {first_line(exc)}")


def _add_policy_command(group: typer.Typer) -> None:
    @group.command("policy")
    def policy(
        name: str = typer.Argument(..., help="Tenant name."),
        threshold: str | None = typer.Option(
            None, "--semantic-threshold", help="Similarity needed for a semantic hit, 0-1."
        ),
        default_threshold: bool = typer.Option(
            False, "--default-threshold", help="Use the server's threshold again."
        ),
        allow_sampled: bool | None = typer.Option(
            None, "--allow-sampled/--no-allow-sampled", help="Serve sampled requests from L3."
        ),
        reserved: str | None = typer.Option(
            None,
            "--kv-reserved-blocks",
            help="Prefix-cache blocks on each worker that other tenants never evict.",
        ),
        max_blocks: str | None = typer.Option(
            None,
            "--kv-max-blocks",
            help="Most prefix-cache blocks the tenant may hold on a worker ('none': no cap).",
        ),
        semantic_entries: str | None = typer.Option(
            None, "--semantic-max-entries",
            help="Semantic-cache entries the tenant may hold ('none': server default).",
        ),
        semantic_bytes: str | None = typer.Option(
            None, "--semantic-max-bytes",
            help="Semantic-cache bytes the tenant may hold ('none': server default).",
        ),
        max_error_rate: str | None = typer.Option(
            None, "--semantic-max-error-rate",
            help="Largest wrong-hit rate the semantic cache may serve, in (0, 1) (default 0.02).",
        ),
    ) -> None:
        """Change a tenant's cache policy; options left out keep their value."""
        new_threshold = number(threshold, float, "--semantic-threshold")
        new_reserved = number(reserved, int, "--kv-reserved-blocks")
        new_rate = number(max_error_rate, float, "--semantic-max-error-rate")
        with transaction() as session:
            tenant = accounts.require_tenant(session, name)
            keep = tenant.semantic_threshold
            accounts.set_tenant_policy(
                session,
                name,
                semantic_threshold=None if default_threshold else pick(new_threshold, keep),
                semantic_allow_sampled=pick(allow_sampled, tenant.semantic_allow_sampled),
                kv_reserved_blocks=pick(new_reserved, tenant.kv_reserved_blocks),
                kv_max_blocks=_optional(max_blocks, "--kv-max-blocks", tenant.kv_max_blocks),
                semantic_max_entries=_optional(
                    semantic_entries, "--semantic-max-entries", tenant.semantic_max_entries
                ),
                semantic_max_bytes=_optional(
                    semantic_bytes, "--semantic-max-bytes", tenant.semantic_max_bytes
                ),
                semantic_max_error_rate=new_rate,
            )
            typer.echo(f"tenant {name} policy updated")


def _optional(text: str | None, option: str, current: int | None) -> int | None:
    """An integer option that ``none`` clears; left out keeps ``current``."""
    if text is None:
        return current
    if text.strip().lower() == "none":
        return None
    return number(text, int, option)


def _tenant_group() -> typer.Typer:
    group = typer.Typer(help="Create and list tenants; set their policy.", no_args_is_help=True)

    @group.command("create")
    def create(name: str = typer.Argument(..., help="Tenant name (A-Za-z0-9._-).")) -> None:
        """Create a tenant."""
        with transaction() as session:
            tenant = accounts.create_tenant(session, name)
            typer.echo(f"tenant {tenant.name} created (id {tenant.id})")

    @group.command("list")
    def list_() -> None:
        """List tenants and their cache policy."""
        with transaction() as session:
            rows = [
                (t.id, t.name, iso(t.created_at), t.semantic_threshold,
                 t.semantic_allow_sampled, t.kv_reserved_blocks, t.kv_max_blocks,
                 t.semantic_max_entries, t.semantic_max_bytes, t.semantic_max_error_rate)
                for t in accounts.list_tenants(session)
            ]
        header = ("id", "name", "created_at", "semantic_threshold", "allow_sampled", "kv_reserved",
                  "kv_max", "semantic_max_entries", "semantic_max_bytes", "semantic_max_error_rate")
        print_rows(header, rows)

    _add_policy_command(group)
    return group


def _key_group() -> typer.Typer:
    group = typer.Typer(help="Create, list and revoke API keys.", no_args_is_help=True)

    @group.command("create")
    def create(
        tenant: str = typer.Argument(..., help="Tenant name."),
        name: str | None = typer.Option(None, help="A label for the key."),
        rpm: str | None = typer.Option(None, "--rpm", help="Requests per minute limit."),
        tpm: str | None = typer.Option(None, "--tpm", help="Tokens per minute limit."),
    ) -> None:
        """Create a key and print it once (only its hash is stored)."""
        limits = {
            "requests_per_minute": number(rpm, int, "--rpm"),
            "tokens_per_minute": number(tpm, int, "--tpm"),
        }
        with transaction() as session:
            row, plaintext = accounts.create_key(session, tenant, name, **limits)
            key_id = row.id
        typer.echo(f"key_id {key_id}")
        typer.echo(f"key {plaintext}")
        typer.echo("store this key now: it cannot be shown again", err=True)

    @group.command("list")
    def list_(tenant: str = typer.Argument(..., help="Tenant name.")) -> None:
        """List a tenant's keys (never the keys themselves)."""
        with transaction() as session:
            rows = [
                (k.id, k.display_prefix, k.name, iso(k.created_at), iso(k.revoked_at))
                for k in accounts.list_keys(session, tenant)
            ]
        print_rows(("key_id", "prefix", "name", "created_at", "revoked_at"), rows)

    @group.command("revoke", help=REVOKE_HELP)
    def revoke(key_id: str = typer.Argument(..., help="Key id (key_...).")) -> None:
        with transaction() as session:
            row = accounts.revoke_key(session, key_id)
            typer.echo(f"key {row.id} revoked at {iso(row.revoked_at)}")

    return group


def register(app: typer.Typer) -> None:
    """Add the ``db``, ``tenant``, ``key``, ``price`` and ``budget`` groups to the root CLI."""
    app.add_typer(_db_group(), name="db")
    app.add_typer(_tenant_group(), name="tenant")
    app.add_typer(_key_group(), name="key")
    app.add_typer(price_group(), name="price")
    app.add_typer(budget_group(), name="budget")
