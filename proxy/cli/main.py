"""Root of the ``kvtoll`` CLI: assembles each area's command group.

Each group lives beside the code it drives (``billing/cli.py``, ``engine/cli.py``,
...); this module only wires them together. Caller mistakes print one line and exit 2.
"""

from __future__ import annotations

import typer

from billing.cli import register as register_billing
from billing.invoice_cli import register as register_invoices
from engine.cli import register as register_engine
from proxy.cli.serve import register as register_serve


def build_app() -> typer.Typer:
    app = typer.Typer(
        name="kvtoll",
        help="Multi-tenant LLM gateway with semantic, prefix and paged-KV caching.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )
    register_billing(app)
    register_invoices(app)
    register_engine(app)
    register_serve(app)
    from bench.cli import app as bench_app  # tooling: loaded only when the CLI is built

    app.add_typer(bench_app, name="bench")
    return app


def main() -> None:
    build_app()()
