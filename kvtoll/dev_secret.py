"""The dev-mode server secret: random, made once per data directory, never shipped.

``KVTOLL_DEV_MODE=1`` without ``KVTOLL_SECRET`` signs sessions and derives tenant
prefix-cache salts with 32 random bytes kept in ``{data_dir}/dev-secret`` (mode 0600).
Every process using that data directory reads the same file, so sessions survive a
restart; nobody without the file can forge a cookie or compute a tenant's salt.
The file is created atomically (written aside, then hard-linked into place), so two
processes starting at once agree on one secret.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path

FILE_NAME = "dev-secret"
_NUM_BYTES = 32


def dev_secret(data_dir: str | os.PathLike[str]) -> bytes:
    """The secret in ``data_dir``, made on first use; ``ValueError`` if unusable."""
    path = Path(data_dir) / FILE_NAME
    try:
        if not path.exists():
            _create(path)
        mode = path.stat().st_mode
        if stat.S_IMODE(mode) & 0o077:
            raise ValueError(f"{path} is readable by others: chmod 600 it")
        value = path.read_text().strip()
    except OSError as exc:
        raise ValueError(f"cannot use the dev-mode secret {path}: {exc.strerror}") from None
    if len(value) < 2 * _NUM_BYTES:
        raise ValueError(f"{path} is not a kvtoll dev-mode secret (delete it to make a new one)")
    return value.encode()


def _create(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    aside = path.with_name(f".{FILE_NAME}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_hex(_NUM_BYTES) + "\n")
            out.flush()
            os.fsync(out.fileno())
        with contextlib.suppress(FileExistsError):  # another process won the race
            os.link(aside, path)
    finally:
        aside.unlink(missing_ok=True)
