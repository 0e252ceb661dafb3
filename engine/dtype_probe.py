"""The bfloat16 speed probe of ``--dtype auto``, measured once per machine and kept.

A start-up timing probe on a busy machine can land either side of the threshold, so
two workers on one machine once chose different dtypes (and one temperature-0 prompt
got two answers). The probe's result is therefore persisted per machine: the first
engine to start measures it while holding an exclusive lock on the file, every later
start (concurrent ones wait on the lock) reads the same figure. The file is keyed by
what makes a machine's answer differ (CPU model, its flags, torch's version); a
different key is measured again. Delete the file to measure again.

File: ``$XDG_CACHE_HOME/kvtoll/dtype-probe.json`` (default ``~/.cache``), JSON
``{"key": ..., "bf16_speedup": float, "measured_at": unix seconds}``. :func:`persisted`
keeps other start-up races the same way (engine.model.native_linear's row limit).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

FILE_NAME = "dtype-probe.json"


@dataclass(frozen=True)
class ProbeResult:
    bf16_speedup: float
    path: Path
    measured_now: bool  # False: read from the file another start wrote


def default_path(name: str = FILE_NAME) -> Path:
    """Where a probe named ``name`` is kept (the dtype probe's by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvtoll" / name


def machine_key(flags: frozenset[str], cpu_model: str, torch_version: str) -> str:
    """What the probe's answer depends on, hashed."""
    text = "|".join((cpu_model, " ".join(sorted(flags)), torch_version))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _read(path: Path, key: str, field: str) -> float | None:
    """``field`` of ``path`` if the file was written for ``key`` and holds a number >= 0."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("key") != key:
        return None
    value = data.get(field)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        return None
    return float(value)


def persisted_speedup(
    key: str, measure: Callable[[], float], path: Path | None = None
) -> ProbeResult:
    """The machine's bf16 speedup: read from ``path`` if it was measured for ``key``, else
    ``measure()`` it once (under an exclusive lock, so concurrent starts agree) and keep it.
    Falls back to measuring without keeping when the directory is not writable."""
    path = path or default_path()
    value, measured_now = persisted(key, "bf16_speedup", measure, path)
    return ProbeResult(value, path, measured_now)


def persisted(
    key: str, field: str, measure: Callable[[], float], path: Path
) -> tuple[float, bool]:
    """A start-up measurement kept per machine: ``field`` of the JSON file ``path`` if it
    was written for ``key``, else ``measure()`` (a number >= 0) once, under an exclusive
    lock so concurrent starts agree, kept with the key. The value, and whether it was
    measured now."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_suffix(".lock"), "a+")  # noqa: SIM115 - held across the probe
    except OSError as exc:
        log.warning("probe: cannot keep its result in %s (%s): measuring", path, exc)
        return measure(), True
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        known = _read(path, key, field)
        if known is not None:
            return known, False
        value = measure()
        body = {"key": key, field: value, "measured_at": time.time()}
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(body))
            tmp.replace(path)
        except OSError as exc:
            log.warning("probe: cannot write %s (%s)", path, exc)
        return value, True
