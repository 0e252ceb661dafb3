"""The error bound's per-tenant figures for ``/metrics`` and the dashboards.

Figures are this process's (each replica counts the lookups it answered; Prometheus
sums replicas): hits served, would-be hits explored and checked, the measured wrong-hit
rate of what the bound serves (wrong explored checks / explored checks: exploration
samples the would-be hits uniformly) with its 95% Wilson interval, hits clients
reported wrong, and the tenant's bound.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from proxy.semantic.stats import SemanticStats, TenantBoundStats


def bound_row(tenant_id: str, name: str, stats: TenantBoundStats) -> dict[str, Any]:
    """One tenant's figures as plain values (what the dashboards render)."""
    rate, low, high = stats.wrong_hit_rate()
    return {
        "tenant_id": int(tenant_id) if tenant_id.isdigit() else tenant_id, "tenant": name,
        "hits": stats.hits, "explored": stats.explored, "explored_checked": stats.explored_checked,
        "explored_wrong": stats.explored_wrong, "feedback_wrong": stats.feedback_wrong,
        "wrong_hit_rate": rate, "wrong_hit_rate_low": low, "wrong_hit_rate_high": high,
        "max_error_rate": stats.max_error_rate,
    }  # fmt: skip


def bound_rows(stats: SemanticStats, names: Mapping[str, str]) -> list[dict[str, Any]]:
    """Every tenant this process has looked up for, by name."""
    rows = [bound_row(t, names.get(t, t), s) for t, s in list(stats.tenants.items())]
    return sorted(rows, key=lambda r: str(r["tenant"]))


class BoundCollector(Collector):
    """Exports :func:`bound_rows` at scrape time (label ``tenant``: the tenant's name)."""

    def __init__(self, rows: Callable[[], list[dict[str, Any]]]) -> None:
        self._rows = rows

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        rows = self._rows()
        counters = {
            "hits": ("kvtoll_semantic_tenant_hits", "Semantic hits served, per tenant"),
            "explored": ("kvtoll_semantic_explored", "Would-be hits answered by the engine "
                         "instead to check them (billed as misses), per tenant"),
            "explored_checked": ("kvtoll_semantic_explored_checked",
                                 "Explored hits compared with the engine's answer"),
            "explored_wrong": ("kvtoll_semantic_explored_wrong",
                               "Explored hits whose stored answer was wrong"),
            "feedback_wrong": ("kvtoll_semantic_feedback_wrong", "Hits reported wrong by clients"),
        }  # fmt: skip
        for field, (name, text) in counters.items():
            family = CounterMetricFamily(name, text, labels=["tenant"])
            for row in rows:
                family.add_metric([str(row["tenant"])], float(row[field]))
            yield family
        gauges = {
            "wrong_hit_rate": ("kvtoll_semantic_wrong_hit_rate",
                               "Measured wrong-hit rate of served hits (explored sample)"),
            "wrong_hit_rate_low": ("kvtoll_semantic_wrong_hit_rate_low",
                                   "Lower end of its 95% Wilson interval"),
            "wrong_hit_rate_high": ("kvtoll_semantic_wrong_hit_rate_high",
                                    "Upper end of its 95% Wilson interval"),
            "max_error_rate": ("kvtoll_semantic_max_error_rate", "The tenant's error bound"),
        }  # fmt: skip
        for field, (name, text) in gauges.items():
            gauge = GaugeMetricFamily(name, text, labels=["tenant"])
            for row in rows:
                if row[field] is not None:
                    gauge.add_metric([str(row["tenant"])], float(row[field]))
            yield gauge
