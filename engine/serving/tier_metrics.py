"""``GET /metrics`` of a worker with tier 2: Prometheus text of each tier.

``kvtoll_kv_tier_bytes{tier}`` (host: memory, disk: spill dir; shared: bytes this
worker wrote), ``_hits_total``, ``_misses_total``, ``_stores_total``,
``_dropped_total``, ``_evictions_total``, ``_corrupt_total``, ``_errors_total``
(shared store faults), ``kvtoll_kv_tier_loads_total`` (blocks loaded into the pool),
``kvtoll_kv_tier_load_seconds_total``, ``kvtoll_kv_tier_prefetched_total`` (blocks
copied from the shared store), ``kvtoll_kv_tier_load_fraction`` (measured load cost
over recompute cost; -1 until measured), ``kvtoll_kv_tier_write_queue_blocks`` (blocks
waiting for the write-behind thread).
"""

from __future__ import annotations

from engine.kv.tier.tier import KVTier


def tier_metrics_text(tier: KVTier) -> str:
    host, disk = tier.host.stats, tier.host.disk_stats
    rows: list[tuple[str, str, float]] = []
    for name, stats, size in (
        ("host", host, tier.host.num_bytes),
        ("disk", disk, tier.host.num_disk_bytes),
    ):
        rows += [
            ("bytes", name, size),
            ("hits_total", name, stats.hits),
            ("misses_total", name, stats.misses),
            ("stores_total", name, stats.stores),
            ("dropped_total", name, stats.dropped),
            ("evictions_total", name, stats.evictions),
            ("corrupt_total", name, stats.corrupt),
        ]
    if tier.shared is not None:
        s = tier.shared.stats
        rows += [
            ("bytes", "shared", tier.writer.bytes_shared),
            ("hits_total", "shared", s.hits),
            ("misses_total", "shared", s.misses),
            ("stores_total", "shared", s.stores),
            ("dropped_total", "shared", s.dropped),
            ("errors_total", "shared", s.errors),
        ]
    lines = [f'kvtoll_kv_tier_{m}{{tier="{t}"}} {v}' for m, t, v in rows]
    fraction = tier.cost.load_fraction(tier.block_size)
    lines += [
        f"kvtoll_kv_tier_loads_total {tier.num_loaded_blocks}",
        f"kvtoll_kv_tier_load_seconds_total {tier.load_seconds:.6f}",
        f"kvtoll_kv_tier_prefetched_total {tier.num_prefetched_blocks}",
        f"kvtoll_kv_tier_skipped_loads_total {tier.num_skipped_loads}",
        f"kvtoll_kv_tier_write_dropped_total {tier.writer.num_dropped}",
        f"kvtoll_kv_tier_write_queue_blocks {tier.writer.num_queued}",
        f"kvtoll_kv_tier_load_fraction {-1 if fraction is None else round(fraction, 6)}",
    ]
    return "\n".join(lines) + "\n"
