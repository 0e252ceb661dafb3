"""A benchmark's result: one JSON object on stdout, and in a file when asked."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(result: Any, out: str | Path | None) -> None:
    """Print ``result`` as indented JSON; also write it (and a newline) to ``out`` if set."""
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
