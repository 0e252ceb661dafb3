"""How much GPU memory the KV cache may take.

On a GPU the KV cache gets what ``gpu_memory_utilization`` of the device's memory
leaves after everything else this process and its neighbours hold: the weights,
the CUDA context, other processes, and the peak of activations that a full-size
warm-up step measured (vLLM's and nano-vllm's rule)::

    kv_bytes = total * utilization - used_now - (peak_allocated - allocated_now)

``used_now`` (total minus free) already counts the weights and the context;
``peak_allocated - allocated_now`` is what a step allocates on top of them and
frees again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_GIB = float(1 << 30)


@dataclass(frozen=True)
class GpuMemory:
    """A snapshot of one GPU's memory, in bytes, taken after a warm-up step."""

    total: int
    free: int
    peak_allocated: int  # torch's peak allocation since the warm-up began
    allocated: int  # torch's allocation now (weights, buffers)

    @property
    def used(self) -> int:
        return self.total - self.free


def check_utilization(utilization: float) -> float:
    """``utilization`` if it is a fraction in (0, 1], else ``ValueError``."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    return utilization


def kv_cache_budget(mem: GpuMemory, utilization: float) -> int:
    """Bytes the KV cache may take; ``ValueError`` when nothing is left for it."""
    check_utilization(utilization)
    transient = max(0, mem.peak_allocated - mem.allocated)
    budget = int(mem.total * utilization) - mem.used - transient
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization {utilization} leaves no room for the KV cache: "
            f"{mem.used / _GIB:.2f} GiB in use and {transient / _GIB:.2f} GiB of "
            f"activations out of {mem.total / _GIB:.2f} GiB"
        )
    return budget


def reset_peak(device: str) -> None:
    """Start a new peak-allocation window on ``device`` (a CUDA device)."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)


def measure(device: str) -> GpuMemory:
    """The memory of ``device`` (a CUDA device) now, and torch's peak since
    :func:`reset_peak`. Torch's cached free blocks go back to the driver first, so
    that ``free`` does not count freed activations as used."""
    torch.cuda.synchronize(device)
    with torch.cuda.device(device):
        torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return GpuMemory(
        total=total,
        free=free,
        peak_allocated=torch.cuda.max_memory_allocated(device),
        allocated=torch.cuda.memory_allocated(device),
    )
