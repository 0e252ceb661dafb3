"""Tier-2 KV configuration: built once (``kvtoll worker`` flags, settings, tests)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.kv.tier.codec import TierMode

SHARED_MODES = ("redis", "peer", "off")


@dataclass(frozen=True)
class TierConfig:
    """``host_bytes``: host-memory budget; ``tenant_fraction``: one tenant's cap as a
    fraction of it (and of ``spill_bytes`` on disk); ``mode``: int8 or raw (the KV
    dtype); ``shared``: ``redis`` (``redis_url``; values live ``ttl_s``; every call
    bounded by ``timeout_s``), ``peer`` or ``off``."""

    host_bytes: int
    tenant_fraction: float = 0.5
    mode: TierMode = TierMode.RAW
    spill_dir: Path | None = None
    spill_bytes: int = 0
    shared: str = "off"
    redis_url: str | None = None
    ttl_s: int = 3600
    timeout_s: float = 0.25
    backoff_s: float = 5.0
    redis_prefix: str = "kvtoll:kvtier"
    queue_blocks: int = 4096  # write-behind backlog cap; beyond it blocks are not kept

    def __post_init__(self) -> None:
        if self.host_bytes <= 0:
            raise ValueError(f"--kv-tier-mb must be positive, got {self.host_bytes}")
        if not 0.0 < self.tenant_fraction <= 1.0:
            raise ValueError(f"tenant_fraction must be within (0, 1], got {self.tenant_fraction}")
        if self.shared not in SHARED_MODES:
            raise ValueError(f"--kv-shared must be redis, peer or off, got {self.shared!r}")
        if self.shared == "redis" and not self.redis_url:
            raise ValueError("--kv-shared redis needs KVTOLL_REDIS_URL (or --redis-url)")
        if self.shared == "peer":
            raise ValueError("--kv-shared peer is not available yet: use redis or off")
        if self.timeout_s <= 0 or self.ttl_s <= 0:
            raise ValueError("the shared tier's timeout and TTL must be positive")
