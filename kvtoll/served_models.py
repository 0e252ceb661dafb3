"""Which models the gateway on a data directory serves, for the CLI that prices them.

``kvtoll serve`` writes the model ids it serves to ``{data_dir}/served-models.json``
when it starts; ``kvtoll price set`` reads them from the same ``KVTOLL_DATA_DIR`` so
that a price for a model no worker serves (a typo, usually) is refused unless forced.
The file is replaced atomically; it is only a hint (the last gateway's list), never
an input to billing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

FILE_NAME = "served-models.json"


def record_served_models(data_dir: str | os.PathLike[str], models: Sequence[str]) -> None:
    """Write ``models`` as the list the gateway on ``data_dir`` serves."""
    path = Path(data_dir) / FILE_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"models": list(models), "written_at": datetime.now(UTC).isoformat(timespec="seconds")}
    aside = path.with_name(f".{FILE_NAME}.{os.getpid()}")
    aside.write_text(json.dumps(body) + "\n")
    os.replace(aside, path)


def read_served_models(data_dir: str | os.PathLike[str]) -> tuple[str, ...] | None:
    """The models last recorded for ``data_dir``, or ``None`` if none is (or unreadable)."""
    try:
        body = json.loads((Path(data_dir) / FILE_NAME).read_text())
        models = body["models"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
        return None
    return tuple(models)
