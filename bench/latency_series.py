"""What ``proxy_overhead.py`` measures beyond medians: per-request latencies under a closed
loop, tail percentiles, whether a gateway's extra latency comes in a periodic spike
train, and the plot of added latency over request index.

Closed loop: ``concurrency`` workers, each on one keep-alive connection (the lean
client of ``semantic_load.py``), for ``seconds``; every response's latency and its
``x-kvtoll-request-id`` (to check the ledger against what was answered) are kept. The
loop runs on uvloop when it is installed (:func:`run_client`; ``client_loop`` says
which): on a saturated machine the client's own CPU is in every target's total, so a
lighter client lets the throughputs show the targets' differences; every target and the
direct upstream are measured by the same client in the same run.

Periodicity: the requests whose added latency exceeds ``spike_ms`` are "spikes"; for
each trial period P in ``periods_s`` the Rayleigh statistic z = n * |mean(exp(2 pi i t / P))|^2
of the spikes' arrival times t tells whether they cluster at one phase of P (a train
with period P gives z ~ n, random spikes z ~ 1). A real train's period drifts (a batch
delay plus a write of varying length), so z is taken per window of ``window_s`` and
averaged over the windows with spikes: random spikes give a mean near 1 at every P, a
train a mean near its spikes per window at its period.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from bench.semantic_load import encode_post, read_response

T = TypeVar("T")


def client_loop() -> str:
    """The event loop :func:`run_client` uses: ``uvloop`` when installed, else ``asyncio``."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def run_client(main: Coroutine[Any, Any, T]) -> T:
    """Run a load generator's coroutine on :func:`client_loop`'s loop."""
    if client_loop() == "asyncio":
        return asyncio.run(main)
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


@dataclass
class LoopResult:
    latencies_ms: list[float] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)
    errors: int = 0
    elapsed_s: float = 0.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def tail(values: list[float]) -> dict[str, float]:
    """p50, p99 and p99.9 of ``values`` (milliseconds), rounded."""
    return {name: round(percentile(values, q), 3)
            for name, q in (("p50_ms", 0.5), ("p99_ms", 0.99), ("p999_ms", 0.999))}


async def closed_loop(url: str, headers: dict[str, str], body: dict[str, Any],
                      concurrency: int, seconds: float) -> LoopResult:
    """See the module doc."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    request = encode_post(f"{host}:{port}", "/v1/chat/completions", headers, body)
    result = LoopResult()
    stop_at = time.perf_counter() + seconds

    async def worker() -> None:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            while time.perf_counter() < stop_at:
                t0 = time.perf_counter()
                writer.write(request)
                status, response_headers, payload = await read_response(reader)
                elapsed = (time.perf_counter() - t0) * 1000
                if status != 200 or not payload.startswith(b"{"):
                    result.errors += 1
                    continue
                result.latencies_ms.append(elapsed)
                request_id = response_headers.get("x-kvtoll-request-id")
                if request_id:
                    result.request_ids.append(request_id)
        finally:
            writer.close()

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    result.elapsed_s = time.perf_counter() - started
    return result


def rayleigh_z(times_s: list[float], period_s: float) -> float:
    """n * |mean(exp(2 pi i t / period))|^2 over ``times_s`` (0 for none)."""
    if not times_s:
        return 0.0
    c = sum(math.cos(2 * math.pi * t / period_s) for t in times_s)
    s = sum(math.sin(2 * math.pi * t / period_s) for t in times_s)
    return (c * c + s * s) / len(times_s)


def windowed_z(times_s: list[float], period_s: float, window_s: float) -> float:
    """Mean over ``window_s`` windows (those with spikes) of :func:`rayleigh_z`."""
    windows: dict[int, list[float]] = {}
    for t in times_s:
        windows.setdefault(int(t // window_s), []).append(t)
    if not windows:
        return 0.0
    return sum(rayleigh_z(w, period_s) for w in windows.values()) / len(windows)


def periodicity(times_s: list[float], added_ms: list[float], spike_ms: float,
                periods_s: list[float], window_s: float = 2.0) -> dict[str, Any]:
    """Spikes (added > ``spike_ms``) and the trial period whose windowed Rayleigh z is
    highest (see the module doc)."""
    spikes = [t for t, a in zip(times_s, added_ms, strict=True) if a > spike_ms]
    best = max(periods_s, key=lambda p: windowed_z(spikes, p, window_s))
    return {"spike_ms": spike_ms, "num_spikes": len(spikes),
            "spike_fraction": round(len(spikes) / max(1, len(added_ms)), 4),
            "strongest_period_s": round(best, 3),
            "windowed_rayleigh_z": round(windowed_z(spikes, best, window_s), 2),
            "spikes_per_window": round(len(spikes) / max(1, len(
                {int(t // window_s) for t in spikes})), 2)}


def plot_added(series: dict[str, list[float]], path: Path, title: str,
               y_max_ms: float = 25.0) -> None:
    """One panel per series: added latency (ms) over request index, on one scale
    (-5 .. ``y_max_ms``, wider for a gateway whose p99 is above it) so that panels
    compare at a glance; the points off the scale are counted in the panel's title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(series), 1, figsize=(11, 2.4 * len(series)), sharex=True,
                             squeeze=False)
    for ax, (name, added) in zip(axes[:, 0], series.items(), strict=True):
        top = max(y_max_ms, 1.2 * percentile(added, 0.99))
        off = sum(1 for a in added if a > top or a < -5)
        ax.plot(range(len(added)), added, linewidth=0.5)
        ax.set_ylim(-5, top)
        ax.set_ylabel("added ms")
        ax.set_title(f"{name}: p50 {percentile(added, 0.5):.2f} ms, "
                     f"p99 {percentile(added, 0.99):.2f} ms, "
                     f"p99.9 {percentile(added, 0.999):.2f} ms ({off} off scale)", fontsize=9)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("request index (sequential client)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
