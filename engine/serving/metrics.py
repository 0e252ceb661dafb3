"""The worker's ``GET /metrics`` (Prometheus text), read from the engine's load at scrape.

Per tenant (label ``tenant``: the name the gateway sends in ``kvtoll_kv_share``):
``kvtoll_worker_kv_cached_blocks``, ``kvtoll_worker_kv_reserved_blocks``,
``kvtoll_worker_kv_max_blocks`` (absent without a cap), and the counters
``kvtoll_worker_kv_prefix_query_blocks_total``, ``kvtoll_worker_kv_prefix_hit_blocks_total``
and ``kvtoll_worker_kv_evicted_blocks_total``. Pool-wide: ``kvtoll_worker_kv_free_blocks``,
``kvtoll_worker_kv_total_blocks``, ``kvtoll_worker_num_running``,
``kvtoll_worker_num_waiting``. A collector on its own registry: nothing global.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.api import EngineLoad

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _LoadCollector(Collector):
    def __init__(self, read: Callable[[], EngineLoad]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        load = self._read()
        for name, value, doc in (
            ("kvtoll_worker_kv_free_blocks", load.num_free_blocks, "KV blocks free"),
            ("kvtoll_worker_kv_total_blocks", load.num_total_blocks, "KV blocks in the pool"),
            ("kvtoll_worker_num_running", load.num_running, "sequences running"),
            ("kvtoll_worker_num_waiting", load.num_waiting, "sequences waiting"),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        yield from _tenant_metrics(load)


def _tenant_metrics(load: EngineLoad) -> Iterator[Metric]:
    cached = GaugeMetricFamily("kvtoll_worker_kv_cached_blocks",
                               "prefix-cache blocks a tenant holds", labels=["tenant"])
    reserved = GaugeMetricFamily("kvtoll_worker_kv_reserved_blocks",
                                 "blocks reserved for a tenant", labels=["tenant"])
    cap = GaugeMetricFamily("kvtoll_worker_kv_max_blocks",
                            "most blocks a tenant may hold", labels=["tenant"])
    queries = CounterMetricFamily("kvtoll_worker_kv_prefix_query_blocks",
                                  "prompt blocks looked up at admission", labels=["tenant"])
    hits = CounterMetricFamily("kvtoll_worker_kv_prefix_hit_blocks",
                               "prompt blocks found in the prefix cache", labels=["tenant"])
    evicted = CounterMetricFamily("kvtoll_worker_kv_evicted_blocks",
                                  "a tenant's cached blocks dropped", labels=["tenant"])
    for t in load.tenants:
        cached.add_metric([t.tenant], t.cached_blocks)
        reserved.add_metric([t.tenant], t.reserved_blocks)
        if t.max_blocks is not None:
            cap.add_metric([t.tenant], t.max_blocks)
        queries.add_metric([t.tenant], t.query_blocks)
        hits.add_metric([t.tenant], t.hit_blocks)
        evicted.add_metric([t.tenant], t.evicted_blocks)
    yield from (cached, reserved, cap, queries, hits, evicted)


class WorkerMetrics:
    """Renders the worker's metrics from ``read`` (the engine's ``load``)."""

    def __init__(self, read: Callable[[], EngineLoad]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_LoadCollector(read))

    def render(self) -> bytes:
        return generate_latest(self.registry)
