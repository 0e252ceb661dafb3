"""What the CPU this process runs on is: its feature flags and model name, read from
``/proc/cpuinfo`` (Linux). The engine picks kernels and dtypes by them, the gateway's
semantic layer how it multiplies its int8 encoders; both read them here. Reads nothing at
import.
"""

from __future__ import annotations

from pathlib import Path


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first CPU's feature flags (x86 ``flags``, Arm ``Features``); empty if unknown."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The first CPU's model name (x86 ``model name``, Arm ``CPU part``); "" if unknown."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() in ("model name", "CPU part"):
            return value.strip()
    return ""
