"""Results and counters of the semantic cache (what the proxy exports to /metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field

from proxy.semantic.bound import wilson_interval
from proxy.semantic.types import SemanticHit, SemanticProbe


@dataclass(frozen=True)
class LookupTiming:
    """Milliseconds spent in each lookup stage."""

    embed_ms: float = 0.0
    search_ms: float = 0.0
    verify_ms: float = 0.0

    @property
    def total_ms(self) -> float:
        return self.embed_ms + self.search_ms + self.verify_ms


@dataclass(frozen=True)
class LookupResult:
    """Outcome of one lookup; ``reason`` is hit | miss | rejected | explore | held_back |
    bypass | store_error | embed_error. ``probe``: the would-be hit to check against the
    engine's answer (explore, held_back)."""

    hit: SemanticHit | None
    timing: LookupTiming
    reason: str
    probe: SemanticProbe | None = None


@dataclass
class TenantBoundStats:
    """One tenant's error-bound figures in this process (counters are monotonic)."""

    max_error_rate: float | None = None  # the bound last applied
    hits: int = 0  # served from the cache
    explored: int = 0  # would-be hits answered by the engine instead
    explored_checked: int = 0  # of those, compared with the engine's answer
    explored_wrong: int = 0  # of those, where the stored answer was wrong
    held_back: int = 0  # candidates the bound did not serve, checked for free
    held_back_wrong: int = 0
    feedback_wrong: int = 0  # hits a client reported wrong

    def wrong_hit_rate(self, z: float = 1.96) -> tuple[float | None, float, float]:
        """Measured wrong-hit rate of what the bound serves (explored hits are a
        uniform sample of them) and its Wilson interval; None with no sample."""
        low, high = wilson_interval(self.explored_wrong, self.explored_checked, z)
        if not self.explored_checked:
            return None, low, high
        return self.explored_wrong / self.explored_checked, low, high


@dataclass
class SemanticStats:
    """Monotonic counters (process-local) and cumulative stage times."""

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    rejections: int = 0  # misses where the verifier turned down at least one candidate
    bypassed: int = 0  # not cacheable (sampling without opt-in, non-text turn, ...)
    stored: int = 0
    store_skipped: int = 0  # incomplete answers, tool calls not allowed, not cacheable
    store_errors: int = 0  # backend failures, each turned into a miss / no-op
    embed_errors: int = 0  # embedder failures, each turned into a miss / no-op
    evictions: int = 0
    invalidations: int = 0
    other_embedder: int = 0  # entries not mirrored: their vector is another embedder's
    embed_ms_total: float = 0.0
    search_ms_total: float = 0.0
    verify_ms_total: float = 0.0
    last: LookupTiming = field(default_factory=LookupTiming)
    tenants: dict[str, TenantBoundStats] = field(default_factory=dict)

    def tenant(self, tenant_id: str) -> TenantBoundStats:
        """One tenant's bound figures (created on first use)."""
        found = self.tenants.get(tenant_id)
        if found is None:
            found = self.tenants[tenant_id] = TenantBoundStats()
        return found

    def observe(self, timing: LookupTiming) -> None:
        """Add one lookup's stage times."""
        self.embed_ms_total += timing.embed_ms
        self.search_ms_total += timing.search_ms
        self.verify_ms_total += timing.verify_ms
        self.last = timing
