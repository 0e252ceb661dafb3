"""Where the Alembic scripts live: this package's directory.

A submodule rather than ``migrations.__file__`` so that it resolves to the real
files even when a same-named test directory shadows the top-level package.
"""

from __future__ import annotations

from pathlib import Path


def script_location() -> Path:
    """The directory holding ``env.py`` and ``versions/``."""
    return Path(__file__).resolve().parent
