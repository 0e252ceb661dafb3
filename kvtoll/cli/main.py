"""Root of the ``kvtoll`` CLI: a command's group is imported only when it runs.

Every group lives beside the code it drives and exposes ``register(app)``, which adds
its commands to the root Typer app. The root knows each command only by name, module
and one-line help (:data:`COMMANDS`): ``kvtoll --help`` imports none of them, and
``kvtoll tenant list`` imports billing alone, so neither pays for torch, the engine or
the gateway. Caller mistakes print one ``error:`` line and exit 2
(:func:`kvtoll.cli.errors.fail`).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import typer
from typer._click.exceptions import ClickException, NoArgsIsHelpError  # typer vendors click

from kvtoll.settings import SettingsError


@dataclass(frozen=True)
class LazyCommand:
    """A top-level command: the module whose ``register(app)`` adds it, its help, and
    environment defaults set before that module is imported: all of them where the
    environment sets none (they are one choice), else none."""

    module: str
    help: str
    environ: tuple[tuple[str, str], ...] = ()


# For the commands that run a CPU engine. An idle libgomp worker spins (pause loops) for
# up to ~300,000 iterations before it sleeps, on cores that the engine's other threads
# need: the fused small ops' second thread, the event loop, HTTP clients, and (before
# the native attention moved onto torch's runtime) a second OpenMP runtime's workers. On
# 2 cores a parallel region then waits for a thread that has half a core. PASSIVE: idle
# workers sleep at once (a futex wake per parallel region instead, ~11 us). On the 2-core
# Xeon (AMX) with other jobs running, a 64-row SmolLM2 decode step (bfloat16, 300 cached
# tokens each, best of 20) took 548 ms spinning and 114 ms passive; with one runtime, the
# worker's 64-request bench ran at ~200 output tok/s with ACTIVE against ~560 passive.
# With the native GEMM kernels a step runs ~120 short parallel regions whose gaps (tens
# of microseconds of Python and single-threaded small ops) each cost a sleep and a
# wake-up; GOMP_SPINCOUNT bounds the spin instead (10,000 pause loops, tens of
# microseconds, then sleep: the gaps between steps still free the core). On the Zen 4
# EPYC, 64 requests over HTTP, first round, alternating servers: int8 linears 467 / 467
# tok/s vs 396 / 414 passive (30,000 spins: 493 / 457 / 508); bfloat16 323 vs 314.
# On the 2-core AMX Xeon with the AMX linears (bfloat16, same run, a worker each,
# alternating): 3,000 spins 408 / 423 tok/s, 10,000 471 / 490, 30,000 452 / 467; the
# cached-1k TTFT 54 ms at 3,000, 43-51 ms at 10,000.
# libgomp reads the variables once, when it is loaded (torch's on ``import torch``),
# hence here, before the command's import.
ENGINE_PROCESS_ENV = (("OMP_WAIT_POLICY", "PASSIVE"), ("GOMP_SPINCOUNT", "10000"))


COMMANDS: dict[str, LazyCommand] = {
    "serve": LazyCommand(
        "proxy.cli.serve", "Run the gateway (without --worker, with an engine).", ENGINE_PROCESS_ENV
    ),
    "worker": LazyCommand(
        "engine.cli", "Run an engine worker: the OpenAI API over one engine.", ENGINE_PROCESS_ENV
    ),
    "db": LazyCommand("billing.cli", "Database schema migrations."),
    "tenant": LazyCommand("billing.cli", "Create and list tenants; set their policy."),
    "key": LazyCommand("billing.cli", "Create, list and revoke API keys."),
    "price": LazyCommand("billing.cli", "Prices per model (USD per 1M tokens)."),
    "budget": LazyCommand("billing.cli", "Monthly spend budgets per tenant and key."),
    "invoice": LazyCommand("billing.invoice_cli", "Close billing periods and export invoices."),
    "bench": LazyCommand("bench.cli", "Benchmarks (print JSON figures)."),
}


def _requested(argv: Sequence[str]) -> str | None:
    """The command ``argv`` names (the root takes no options but ``--help``)."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def _listed_only(name: str, help_text: str) -> Callable[[], None]:
    """A stand-in that only lists ``name`` in the root's help; never invoked, since the
    command line that names it loads the real command instead."""

    def stand_in() -> None:
        raise RuntimeError(f"kvtoll {name} was not loaded")

    stand_in.__doc__ = help_text
    return stand_in


def build_app(argv: Sequence[str] | None = None) -> typer.Typer:
    """The root CLI. With ``argv``, only the module of the command it names is imported
    (the others are listed by name and help); without, every command is loaded."""
    app = typer.Typer(
        name="kvtoll",
        help="Multi-tenant LLM gateway with semantic, prefix and paged-KV caching.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )
    wanted = None if argv is None else _requested(argv)
    if wanted in COMMANDS:
        defaults = COMMANDS[wanted].environ
        if not any(variable in os.environ for variable, _ in defaults):
            os.environ.update(defaults)
    modules = {entry.module for name, entry in COMMANDS.items() if argv is None or name == wanted}
    for module in dict.fromkeys(entry.module for entry in COMMANDS.values()):
        if module in modules:
            importlib.import_module(module).register(app)
    for name, entry in COMMANDS.items():
        if entry.module not in modules:
            app.command(name, help=entry.help)(_listed_only(name, entry.help))
    return app


def run(argv: Sequence[str]) -> int:
    """Run the command line ``argv`` and return its exit code. A mistake in the command
    line itself (unknown option, missing or unparsable value) prints one ``error:`` line
    and returns 2, like the commands' own checks (:func:`kvtoll.cli.errors.fail`)."""
    app = build_app(argv)
    try:
        code = app(args=list(argv), prog_name="kvtoll", standalone_mode=False)
    except NoArgsIsHelpError as exc:
        exc.show()
        return exc.exit_code
    except ClickException as exc:
        message = " ".join(exc.format_message().split())
        typer.echo(f"error: {message} (see --help)", err=True)
        return exc.exit_code
    except SettingsError as exc:
        typer.echo(f"error: {exc}", err=True)
        return 2
    except typer.Abort:
        typer.echo("error: aborted", err=True)
        return 1
    return code if isinstance(code, int) else 0


def main() -> None:
    sys.exit(run(sys.argv[1:]))
