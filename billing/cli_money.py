"""``kvtoll price|budget`` commands: prices per model and monthly spend budgets.

Each command runs in one transaction (:func:`billing.cli_support.transaction`): a bad
price, fraction or unknown tenant prints one ``error:`` line, exits 2 and writes nothing.
"""

from __future__ import annotations

import typer

from billing import accounts, budgets, pricing
from billing.cli_support import iso, parse_moment, print_rows, transaction
from billing.models import Price
from billing.money import exact_usd, ppm_to_fraction, price_per_1m_usd
from kvtoll.cli.errors import fail
from kvtoll.served_models import read_served_models
from kvtoll.settings import load_settings


def _price_row(price: Price) -> tuple[object, ...]:
    return (
        price.model,
        price_per_1m_usd(price.input_pico),
        price_per_1m_usd(price.cached_input_pico),
        price_per_1m_usd(price.output_pico),
        ppm_to_fraction(price.semantic_hit_ppm),
        iso(price.effective_from),
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


def price_group() -> typer.Typer:
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
        moment = parse_moment(effective_from)
        with transaction() as session:
            price = pricing.set_price(
                session, model, input, cached_input, output, semantic_fraction, moment
            )
            if not force:  # after the price's own checks; refusing rolls it back
                _check_served(model)
            typer.echo(f"price for {price.model} effective {iso(price.effective_from)}")

    @group.command("list")
    def list_(
        model: str | None = typer.Option(None, help="Only this model."),
    ) -> None:
        """List every price row, history included."""
        with transaction() as session:
            rows = [_price_row(p) for p in pricing.list_prices(session, model)]
        header = ("model", "input", "cached_input", "output", "semantic_fraction", "effective")
        print_rows(header, rows)

    return group


def budget_group() -> typer.Typer:
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
        with transaction() as session:
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
        with transaction() as session:
            budgets.remove_budget(session, tenant, key)
        typer.echo(f"budget of {tenant}{' key ' + key if key else ''} removed")

    @group.command("list")
    def list_(
        tenant: str | None = typer.Option(None, "--tenant", help="Only this tenant."),
    ) -> None:
        """List budgets with this month's spend (from the ledger)."""
        with transaction() as session:
            tenant_id = None if tenant is None else accounts.require_tenant(session, tenant).id
            rows = [
                (s.budget.tenant_name, s.budget.api_key_id, exact_usd(s.budget.terms.limit_pico),
                 s.budget.alert_at, s.period, exact_usd(s.spent_pico),
                 f"{s.budget.terms.percent_used(s.spent_pico)}%", s.state)
                for s in budgets.budget_statuses(session, tenant_id)
            ]
        header = ("tenant", "key_id", "monthly_usd", "alert_at", "period", "spent_usd", "used",
                  "state")
        print_rows(header, rows)

    return group
