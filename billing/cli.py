"""``kvtoll db|tenant|key|price|budget`` commands.

Settings are read when a command runs (``KVTOLL_DATABASE_URL``). Each command runs
in one transaction: a caller's mistake (unknown tenant, duplicate name, malformed
or revoked key id, bad price or fraction) prints one line, exits 2 and writes
nothing. ``key create`` prints the plaintext key once; it is never stored.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import TypeVar

import typer
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from billing import accounts, budgets, pricing
from billing.db import make_engine, session_factory
from billing.errors import BillingError
from billing.keys import REVOCATION_BOUND_S
from billing.models import Price
from billing.money import exact_usd, ppm_to_fraction, price_per_1m_usd
from billing.schema import schema_problem, sqlite_file_missing
from kvtoll.cli.errors import fail
from kvtoll.served_models import read_served_models
from kvtoll.settings import load_settings

T = TypeVar("T")
REVOKE_HELP = (f"Revoke a key: every gateway refuses it within {REVOCATION_BOUND_S} s (the "
               "lifetime of its key cache, while it reaches the database); dashboard "
               "sessions signed in with the key end at once.")


def _first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _database_url() -> str:
    return load_settings().database_url


def _require_schema(url: str, engine: Engine) -> None:
    problem = schema_problem(url, engine)
    if problem:
        fail(problem)


@contextmanager
def _transaction() -> Iterator[Session]:
    """One committed transaction on the configured database; errors become exit 2."""
    url = _database_url()
    engine = _engine(url)
    try:
        _require_schema(url, engine)
        with session_factory(engine).begin() as session:
            yield session
    except BillingError as exc:
        fail(str(exc))
    except SQLAlchemyError as exc:
        fail(f"database error: {_first_line(exc)}")
    finally:
        engine.dispose()


def _engine(url: str) -> Engine:
    """The engine for ``url``, or one ``error:`` line for an unusable URL."""
    try:
        return make_engine(url)
    except BillingError as exc:
        fail(str(exc))


def _print_rows(header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    typer.echo("\t".join(header))
    for row in rows:
        typer.echo("\t".join("-" if v is None else str(v) for v in row))


def _iso(moment: datetime | None) -> str | None:
    return None if moment is None else moment.isoformat(timespec="seconds")


def _parse_moment(text: str | None) -> datetime | None:
    if text is None:
        return None
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        fail(f"--effective-from must be an ISO 8601 time, got {text!r}")
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def _pick(given: T | None, current: T) -> T:
    return current if given is None else given


def _number(text: str | None, kind: Callable[[str], T], option: str) -> T | None:
    """Parse a numeric option ourselves so that a bad value is a one-line error."""
    if text is None:
        return None
    try:
        value = kind(text)
    except ValueError:
        fail(f"{option} must be a number, got {text!r}")
    if value != value or value in (float("inf"), float("-inf")):  # NaN / infinities
        fail(f"{option} must be a finite number, got {text!r}")
    return value


def _db_group() -> typer.Typer:
    group = typer.Typer(help="Database schema migrations.", no_args_is_help=True)

    @group.command("upgrade")
    def upgrade(revision: str = typer.Option("head", help="Target revision.")) -> None:
        """Create or migrate the schema (KVTOLL_DATABASE_URL) up to REVISION."""
        from billing import migrate

        _run_migration(migrate.upgrade, revision)
        typer.echo(f"database at {migrate.current_revision(_database_url())}")

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
        typer.echo(f"database at {migrate.current_revision(_database_url()) or 'base'}")

    @group.command("current")
    def current() -> None:
        """Print the schema revision of the database and the newest one available."""
        from billing import migrate

        url = _database_url()
        try:
            revision = None if sqlite_file_missing(url) else migrate.current_revision(url)
        except BillingError as exc:
            fail(str(exc))
        except SQLAlchemyError as exc:
            fail(f"database error: {_first_line(exc)}")
        typer.echo(f"current {revision or 'base'} head {migrate.head_revision()}")

    return group


def _run_migration(step: Callable[[str, str], None], revision: str) -> None:
    from alembic.util import CommandError

    try:
        step(_database_url(), revision)
    except BillingError as exc:
        fail(str(exc))
    except CommandError as exc:
        fail(_first_line(exc))
    except SQLAlchemyError as exc:
        fail(f"database error: {_first_line(exc)}")


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
        new_threshold = _number(threshold, float, "--semantic-threshold")
        new_reserved = _number(reserved, int, "--kv-reserved-blocks")
        new_rate = _number(max_error_rate, float, "--semantic-max-error-rate")
        with _transaction() as session:
            tenant = accounts.require_tenant(session, name)
            keep = tenant.semantic_threshold
            accounts.set_tenant_policy(
                session,
                name,
                semantic_threshold=None if default_threshold else _pick(new_threshold, keep),
                semantic_allow_sampled=_pick(allow_sampled, tenant.semantic_allow_sampled),
                kv_reserved_blocks=_pick(new_reserved, tenant.kv_reserved_blocks),
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
    return _number(text, int, option)


def _tenant_group() -> typer.Typer:
    group = typer.Typer(help="Create and list tenants; set their policy.", no_args_is_help=True)

    @group.command("create")
    def create(name: str = typer.Argument(..., help="Tenant name (A-Za-z0-9._-).")) -> None:
        """Create a tenant."""
        with _transaction() as session:
            tenant = accounts.create_tenant(session, name)
            typer.echo(f"tenant {tenant.name} created (id {tenant.id})")

    @group.command("list")
    def list_() -> None:
        """List tenants and their cache policy."""
        with _transaction() as session:
            rows = [
                (t.id, t.name, _iso(t.created_at), t.semantic_threshold,
                 t.semantic_allow_sampled, t.kv_reserved_blocks, t.kv_max_blocks,
                 t.semantic_max_entries, t.semantic_max_bytes, t.semantic_max_error_rate)
                for t in accounts.list_tenants(session)
            ]
        header = ("id", "name", "created_at", "semantic_threshold", "allow_sampled", "kv_reserved",
                  "kv_max", "semantic_max_entries", "semantic_max_bytes", "semantic_max_error_rate")
        _print_rows(header, rows)

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
            "requests_per_minute": _number(rpm, int, "--rpm"),
            "tokens_per_minute": _number(tpm, int, "--tpm"),
        }
        with _transaction() as session:
            row, plaintext = accounts.create_key(session, tenant, name, **limits)
            key_id = row.id
        typer.echo(f"key_id {key_id}")
        typer.echo(f"key {plaintext}")
        typer.echo("store this key now: it cannot be shown again", err=True)

    @group.command("list")
    def list_(tenant: str = typer.Argument(..., help="Tenant name.")) -> None:
        """List a tenant's keys (never the keys themselves)."""
        with _transaction() as session:
            rows = [
                (k.id, k.display_prefix, k.name, _iso(k.created_at), _iso(k.revoked_at))
                for k in accounts.list_keys(session, tenant)
            ]
        _print_rows(("key_id", "prefix", "name", "created_at", "revoked_at"), rows)

    @group.command("revoke", help=REVOKE_HELP)
    def revoke(key_id: str = typer.Argument(..., help="Key id (key_...).")) -> None:
        with _transaction() as session:
            row = accounts.revoke_key(session, key_id)
            typer.echo(f"key {row.id} revoked at {_iso(row.revoked_at)}")

    return group


def _price_row(price: Price) -> tuple[object, ...]:
    return (
        price.model,
        price_per_1m_usd(price.input_pico),
        price_per_1m_usd(price.cached_input_pico),
        price_per_1m_usd(price.output_pico),
        ppm_to_fraction(price.semantic_hit_ppm),
        _iso(price.effective_from),
    )


def _check_served(model: str) -> None:
    """Refuse a model the local gateway does not serve; warn if no gateway recorded any."""
    data_dir = load_settings().data_dir
    served = read_served_models(data_dir)
    if served is None:
        typer.echo(f"warning: cannot check that a gateway serves {model!r}: no `kvtoll serve` "
                   f"has recorded its models in {data_dir} (KVTOLL_DATA_DIR)", err=True)
    elif model not in served:
        fail(f"no worker serves model {model!r} (served: {', '.join(served) or 'none'}); "
             "check the name, or pass --force to price it anyway")


def _price_group() -> typer.Typer:
    group = typer.Typer(help="Prices per model (USD per 1M tokens).", no_args_is_help=True)

    @group.command("set")
    def set_(
        model: str = typer.Argument(..., help="Model name as clients send it."),
        input: str = typer.Option(..., "--input", help="USD per 1M uncached prompt tokens."),
        cached_input: str = typer.Option(..., "--cached-input", help="USD per 1M cached."),
        output: str = typer.Option(..., "--output", help="USD per 1M completion tokens."),
        semantic_fraction: str = typer.Option(
            ..., "--semantic-fraction", help="Fraction of the uncached price billed for a hit."
        ),
        effective_from: str | None = typer.Option(
            None, "--effective-from", help="ISO 8601 time (default now; no zone = UTC)."
        ),
        force: bool = typer.Option(
            False, "--force", help="Set it even if the gateway does not serve MODEL."
        ),
    ) -> None:
        """Add a price for MODEL; earlier prices stay in history. MODEL must be one the
        gateway on KVTOLL_DATA_DIR serves (as `kvtoll serve` recorded), unless --force."""
        moment = _parse_moment(effective_from)
        with _transaction() as session:
            price = pricing.set_price(
                session, model, input, cached_input, output, semantic_fraction, moment
            )
            if not force:  # after the price's own checks; refusing rolls it back
                _check_served(model)
            typer.echo(f"price for {price.model} effective {_iso(price.effective_from)}")

    @group.command("list")
    def list_(
        model: str | None = typer.Option(None, help="Only this model."),
    ) -> None:
        """List every price row, history included."""
        with _transaction() as session:
            rows = [_price_row(p) for p in pricing.list_prices(session, model)]
        header = ("model", "input", "cached_input", "output", "semantic_fraction", "effective")
        _print_rows(header, rows)

    return group


def _budget_group() -> typer.Typer:
    group = typer.Typer(help="Monthly spend budgets per tenant and key.", no_args_is_help=True)

    @group.command("set")
    def set_(
        tenant: str = typer.Argument(..., help="Tenant name."),
        key: str | None = typer.Option(None, "--key", help="Only this key (key_...)."),
        monthly_usd: str = typer.Option(..., "--monthly-usd", help="Hard limit, USD/month."),
        alert_at: str | None = typer.Option(
            None, "--alert-at", help="Soft alert at this fraction of it (default 0.8)."
        ),
    ) -> None:
        """Set the monthly budget of TENANT (or of one of its keys)."""
        with _transaction() as session:
            row = budgets.set_budget(session, tenant, key, monthly_usd, alert_at)
            typer.echo(
                f"budget of {row.tenant_name}{' key ' + row.api_key_id if row.api_key_id else ''}"
                f": {exact_usd(row.terms.limit_pico)} USD per month, alert at {row.alert_at}"
            )

    @group.command("remove")
    def remove(
        tenant: str = typer.Argument(..., help="Tenant name."),
        key: str | None = typer.Option(None, "--key", help="The key's budget (key_...)."),
    ) -> None:
        """Remove the budget of TENANT (or of one of its keys)."""
        with _transaction() as session:
            budgets.remove_budget(session, tenant, key)
        typer.echo(f"budget of {tenant}{' key ' + key if key else ''} removed")

    @group.command("list")
    def list_(
        tenant: str | None = typer.Option(None, "--tenant", help="Only this tenant."),
    ) -> None:
        """List budgets with this month's spend (from the ledger)."""
        with _transaction() as session:
            tenant_id = None if tenant is None else accounts.require_tenant(session, tenant).id
            rows = [
                (s.budget.tenant_name, s.budget.api_key_id, exact_usd(s.budget.terms.limit_pico),
                 s.budget.alert_at, s.period, exact_usd(s.spent_pico),
                 f"{s.budget.terms.percent_used(s.spent_pico)}%", s.state)
                for s in budgets.budget_statuses(session, tenant_id)
            ]
        header = ("tenant", "key_id", "monthly_usd", "alert_at", "period", "spent_usd", "used",
                  "state")
        _print_rows(header, rows)

    return group


def register(app: typer.Typer) -> None:
    """Add the ``db``, ``tenant``, ``key``, ``price`` and ``budget`` groups to the root CLI."""
    app.add_typer(_db_group(), name="db")
    app.add_typer(_tenant_group(), name="tenant")
    app.add_typer(_key_group(), name="key")
    app.add_typer(_price_group(), name="price")
    app.add_typer(_budget_group(), name="budget")

