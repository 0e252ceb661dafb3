"""Figures of one simulated replay (what ``kvtoll bench routing`` prints)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from bench.routing.trace import TraceRequest
from proxy.routing.calibration import CalibrationSnapshot


class WorkerTally(Protocol):
    """What the report reads of a simulated worker (``simulate.SimWorker``)."""

    @property
    def num_requests(self) -> int: ...

    @property
    def prefill_tokens(self) -> int: ...


@dataclass(frozen=True)
class SimReport:
    """hit_rate = cached input tokens / input tokens; imbalance = max/mean of the
    prefill (uncached) tokens each worker computed; TTFTs in seconds."""

    policy: str
    num_requests: int
    hit_rate: float
    ttft_mean: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    imbalance: float
    request_imbalance: float  # max/mean of requests per worker
    requests_per_worker: tuple[int, ...]
    prediction_mean_abs_error_tokens: float
    prediction_exact_fraction: float
    sim_wall_s: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, floats rounded for reading."""
        out: dict[str, Any] = {}
        for key, value in asdict(self).items():
            out[key] = round(value, 4) if isinstance(value, float) else value
        out["requests_per_worker"] = list(self.requests_per_worker)
        return out


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (0.0 when empty)."""
    if not sorted_values:
        return 0.0
    rank = max(1, math.ceil(q / 100.0 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def max_over_mean(values: Sequence[float]) -> float:
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else 1.0


def build_report(
    policy: str,
    requests: Sequence[TraceRequest],
    ttfts: Sequence[float],
    cached_tokens: int,
    workers: Sequence[WorkerTally],
    calibration: CalibrationSnapshot,
    wall_s: float,
) -> SimReport:
    """Assemble the figures after a replay."""
    input_tokens = sum(r.input_length for r in requests)
    ordered = sorted(ttfts)
    per_worker = tuple(w.num_requests for w in workers)
    exact = calibration.num_exact / calibration.num_requests if calibration.num_requests else 0.0
    return SimReport(
        policy=policy,
        num_requests=len(requests),
        hit_rate=cached_tokens / input_tokens if input_tokens else 0.0,
        ttft_mean=sum(ordered) / len(ordered) if ordered else 0.0,
        ttft_p50=percentile(ordered, 50),
        ttft_p90=percentile(ordered, 90),
        ttft_p99=percentile(ordered, 99),
        imbalance=max_over_mean([float(w.prefill_tokens) for w in workers]),
        request_imbalance=max_over_mean([float(n) for n in per_worker]),
        requests_per_worker=per_worker,
        prediction_mean_abs_error_tokens=calibration.mean_abs_error_tokens,
        prediction_exact_fraction=exact,
        sim_wall_s=wall_s,
    )
