"""Results and counters of the semantic cache (what the proxy exports to /metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field

from proxy.semantic.types import SemanticHit


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
    """Outcome of one lookup; ``reason`` is hit | miss | rejected | bypass | store_error |
    embed_error."""

    hit: SemanticHit | None
    timing: LookupTiming
    reason: str


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
    embed_ms_total: float = 0.0
    search_ms_total: float = 0.0
    verify_ms_total: float = 0.0
    last: LookupTiming = field(default_factory=LookupTiming)

    def observe(self, timing: LookupTiming) -> None:
        """Add one lookup's stage times."""
        self.embed_ms_total += timing.embed_ms
        self.search_ms_total += timing.search_ms
        self.verify_ms_total += timing.verify_ms
        self.last = timing
