"""Which OpenMP runtime a library's own code loaded into this process.

A wheel such as torch's bundles its OpenMP runtime (``libgomp``, ``libiomp5`` or
``libomp``) under its own directory, often beside a system copy of the same soname;
calls that change how that library's threads behave must reach the copy it loaded,
found here by path in ``/proc/self/maps`` (Linux; elsewhere nothing is found).
"""

from __future__ import annotations

from pathlib import Path

RUNTIMES = ("libgomp", "libiomp5", "libomp")


def loaded_runtime(lib_dir: Path) -> str | None:
    """Path of the OpenMP runtime mapped into this process from ``lib_dir``, if any."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    prefix = str(lib_dir)
    for line in maps.splitlines():
        path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
        if path.startswith(prefix) and Path(path).name.startswith(RUNTIMES):
            return path
    return None
