"""Calibration of the router's predictions: predicted vs reported cached tokens.

Per request the router predicted some cached prompt tokens on the chosen worker; the
worker then reports ``cached_tokens`` in its usage. The signed error (predicted −
reported) tells whether the index over- or under-estimates; the histogram of the
absolute error is what the proxy exports to ``/metrics``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

DEFAULT_ERROR_BUCKETS: tuple[float, ...] = (0, 16, 64, 256, 1024, 4096, 16384, 65536)


@dataclass(frozen=True)
class CalibrationSnapshot:
    """Totals so far; ``buckets`` are cumulative (Prometheus ``le``) counts of |error|."""

    num_requests: int
    num_exact: int
    sum_predicted_tokens: int
    sum_reported_tokens: int
    sum_error_tokens: int  # signed: > 0 means the router over-predicted
    sum_abs_error_tokens: int
    buckets: tuple[tuple[float, int], ...] = field(default_factory=tuple)

    @property
    def mean_abs_error_tokens(self) -> float:
        return self.sum_abs_error_tokens / self.num_requests if self.num_requests else 0.0


class CalibrationStats:
    """Accumulates prediction errors; cheap enough to call per request."""

    def __init__(self, bucket_bounds: tuple[float, ...] = DEFAULT_ERROR_BUCKETS) -> None:
        if list(bucket_bounds) != sorted(bucket_bounds):
            raise ValueError("bucket bounds must be ascending")
        self._bounds = bucket_bounds
        self._bucket_counts = [0] * (len(bucket_bounds) + 1)  # last: +Inf
        self._num = self._exact = 0
        self._predicted = self._reported = self._error = self._abs_error = 0

    def record(self, predicted_tokens: int, reported_tokens: int) -> None:
        """Add one request's prediction and the worker's report."""
        if predicted_tokens < 0 or reported_tokens < 0:
            raise ValueError("token counts must be non-negative")
        error = predicted_tokens - reported_tokens
        self._num += 1
        self._exact += error == 0
        self._predicted += predicted_tokens
        self._reported += reported_tokens
        self._error += error
        self._abs_error += abs(error)
        self._bucket_counts[bisect.bisect_left(self._bounds, abs(error))] += 1

    def snapshot(self) -> CalibrationSnapshot:
        """Frozen totals and cumulative histogram (last bucket ``inf``)."""
        cumulative: list[tuple[float, int]] = []
        running = 0
        for bound, count in zip((*self._bounds, float("inf")), self._bucket_counts, strict=True):
            running += count
            cumulative.append((bound, running))
        return CalibrationSnapshot(
            num_requests=self._num,
            num_exact=self._exact,
            sum_predicted_tokens=self._predicted,
            sum_reported_tokens=self._reported,
            sum_error_tokens=self._error,
            sum_abs_error_tokens=self._abs_error,
            buckets=tuple(cumulative),
        )
