"""One-line CLI errors with exit code 2, shared by every command group."""

from __future__ import annotations

from typing import NoReturn

import typer


class CliError(Exception):
    """A caller's mistake: printed as one line, exit code 2, nothing written."""


def fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=2)
