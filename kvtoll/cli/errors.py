"""One-line CLI errors with exit code 2, shared by every command group."""

from __future__ import annotations

from typing import NoReturn

import typer


def fail(message: str) -> NoReturn:
    """Print ``error: message`` on stderr and exit with code 2 (a caller's mistake)."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=2)
