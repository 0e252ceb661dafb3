"""``kvtoll bench``: the benchmark command group.

Each area contributes one plain function with typer-annotated parameters in its own
``bench_cli`` module; :func:`register` adds the ones that exist as subcommands::

    proxy/semantic/bench_cli.py  semantic_command  -> kvtoll bench semantic
    proxy/routing/bench_cli.py   routing_command   -> kvtoll bench routing

To add one: write ``proxy/<area>/bench_cli.py`` with ``<name>_command`` and add a
line to :data:`BENCH_COMMANDS`. Modules are imported only when the CLI is built.
"""

from __future__ import annotations

import importlib
import importlib.util

import typer

# (subcommand, module, function)
BENCH_COMMANDS: tuple[tuple[str, str, str], ...] = (
    ("semantic", "proxy.semantic.bench_cli", "semantic_command"),
    ("routing", "proxy.routing.bench_cli", "routing_command"),
)


def build_bench() -> typer.Typer:
    """The ``bench`` group with every contributed subcommand whose module exists."""
    bench = typer.Typer(help="Benchmarks (print JSON figures).", no_args_is_help=True)
    for name, module_name, function in BENCH_COMMANDS:
        if importlib.util.find_spec(module_name) is None:
            continue  # that area has not contributed its benchmark
        module = importlib.import_module(module_name)
        bench.command(name)(getattr(module, function))
    return bench


def register(app: typer.Typer) -> None:
    """Add ``kvtoll bench`` to the root CLI."""
    app.add_typer(build_bench(), name="bench")
