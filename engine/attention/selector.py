"""Which attention backend runs: ``auto`` = Triton on CUDA (when Triton is installed),
the CPU kernel backend on CPU (the native AVX-512 kernels, launched on torch's OpenMP
threads, or else decode in a numba kernel on numba's threads, with the rest in torch;
torch alone where numba has no thread-safe parallel back end for that fallback), torch
elsewhere;
``torch``, ``cpu`` and ``triton`` force one. Triton on a CPU device is allowed
only under the Triton interpreter (``TRITON_INTERPRET=1``), which tests use.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from engine.attention.base import AttentionBackend

BACKEND_NAMES = ("auto", "torch", "cpu", "triton")


def triton_available() -> bool:
    """Whether the ``triton`` package can be imported here."""
    return importlib.util.find_spec("triton") is not None


def cpu_kernels_available() -> bool:
    """Whether the CPU kernel backend can run here, whichever of its kernels build:
    numba has a thread-safe parallel back end (libgomp or libtbb) for its fallback."""
    from engine.kernels.numba_threads import threadsafe_parallelism_available

    return threadsafe_parallelism_available()


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def resolve_backend_name(name: str, device: torch.device | str) -> str:
    """``torch``, ``cpu`` or ``triton`` for a setting value and a device; ValueError if
    impossible."""
    dev = torch.device(device)
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention backend {name!r}: choose one of {', '.join(BACKEND_NAMES)}")
    if name == "auto":
        if dev.type == "cuda" and triton_available():
            return "triton"
        if dev.type == "cpu" and cpu_kernels_available():
            return "cpu"
        return "torch"
    if name == "cpu" and dev.type != "cpu":
        raise ValueError(f"attention backend 'cpu' needs the CPU device (got {dev.type})")
    if name == "cpu" and not cpu_kernels_available():
        raise ValueError("attention backend 'cpu' needs numba with libgomp or libtbb")
    if name == "triton":
        if not triton_available():
            raise ValueError("attention backend 'triton' needs the triton package")
        if dev.type != "cuda" and not _interpreting():
            raise ValueError(
                f"attention backend 'triton' needs a CUDA device (got {dev.type}); "
                "on CPU set TRITON_INTERPRET=1 to run the kernels in the Triton interpreter"
            )
    return name


def select_attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """The backend for a setting value (``auto``/``torch``/``cpu``/``triton``) on ``device``."""
    dev = torch.device(device)
    resolved = resolve_backend_name(name, dev)
    if resolved == "cpu":
        from engine.attention.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend()
    if resolved == "triton":
        from engine.attention.triton_backend import TritonAttentionBackend, kernels_run_on_cpu

        if dev.type != "cuda" and not kernels_run_on_cpu():
            raise ValueError(
                "TRITON_INTERPRET=1 was set after the Triton kernels were imported; "
                "set it before the process imports engine.kernels"
            )
        return TritonAttentionBackend()
    from engine.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()
