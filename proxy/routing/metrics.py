"""Prometheus view of the router, read at scrape time (no counters to keep in step).

Register once on the app's registry: ``metrics.registry.register(RoutingCollector(
stack.router, stack.registry))``. Exposes:

* ``kvtoll_router_prediction_error_tokens`` (histogram): |predicted − reported| cached
  prompt tokens per completed request, plus ``_sum``/``_count``;
* ``kvtoll_router_prediction_signed_error_tokens_total``: Σ(predicted − reported)
  (> 0: the index over-predicts);
* ``kvtoll_router_pending_prefill_tokens{worker}``: prompt tokens routed to a worker
  that have not produced a first token;
* ``kvtoll_router_worker_healthy{worker}`` and ``kvtoll_router_indexed_blocks{worker}``.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from proxy.routing.registry import WorkerRegistry
from proxy.routing.router import PrefixRouter


class RoutingCollector(Collector):
    """A custom collector over one :class:`PrefixRouter` (and its registry, if any)."""

    def __init__(self, router: PrefixRouter, registry: WorkerRegistry | None = None) -> None:
        self._router = router
        self._registry = registry

    def collect(self) -> Iterator[HistogramMetricFamily | GaugeMetricFamily | CounterMetricFamily]:
        snap = self._router.calibration.snapshot()
        histogram = HistogramMetricFamily(
            "kvtoll_router_prediction_error_tokens",
            "Absolute error of the router's predicted cached prompt tokens per request",
        )
        buckets = [(_le(bound), float(count)) for bound, count in snap.buckets]
        histogram.add_metric([], buckets, float(snap.sum_abs_error_tokens))
        yield histogram
        yield CounterMetricFamily(
            "kvtoll_router_prediction_signed_error_tokens",
            "Sum of predicted minus reported cached prompt tokens",
            value=float(snap.sum_error_tokens),
        )
        yield from self._worker_gauges()

    def _worker_gauges(self) -> Iterator[GaugeMetricFamily]:
        pending = GaugeMetricFamily(
            "kvtoll_router_pending_prefill_tokens",
            "Prompt tokens routed to the worker without a first token yet",
            labels=["worker"],
        )
        healthy = GaugeMetricFamily(
            "kvtoll_router_worker_healthy",
            "1 while the worker is a routing candidate",
            labels=["worker"],
        )
        blocks = GaugeMetricFamily(
            "kvtoll_router_indexed_blocks",
            "Blocks the precise index holds for the worker",
            labels=["worker"],
        )
        workers = self._registry.workers() if self._registry is not None else []
        for info in workers:
            pending.add_metric([info.worker_id], self._router.pending_tokens(info.worker_id))
            healthy.add_metric([info.worker_id], 1.0 if info.healthy else 0.0)
            blocks.add_metric([info.worker_id], self._router.precise.num_blocks(info.worker_id))
        yield pending
        yield healthy
        yield blocks


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))
