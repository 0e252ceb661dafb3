"""Tenant-fair scheduling policy: whose waiting work goes first, and whose short
prefill may run *inside* a step of other tenants' work.

Why. On a CPU worker a step with a long prefill chunk takes hundreds of ms, and even
a decode-only step of a small model costs about as much as a short prefill (per-layer
overhead: SmolLM2-135M, 2 busy cores, 50-180 ms either way). A request that arrives
while a step runs waits for all of it, however short its own work (a prefix-cache hit
needs one small chunk): under another tenant's flood a step is almost always running.
Ordering the queue cannot help with a step already running; shrinking chunks costs
the flooding tenant's throughput in per-step overhead and leaves the decode steps.
vLLM and SGLang bound step time only by the token budget
(``max_num_batched_tokens`` / ``chunked_prefill_size``, vLLM V0's
``long_prefill_token_threshold``) and order by arrival or a request priority, with
preemption by priority; none of them is fair across tenants. The fair order here is
after VTC (Sheng et al., "Fairness in Serving Large Language Models", OSDI'24):
serve the tenant that has received the least, counted in tokens.

Algorithm
---------
1. **Usage.** Each tenant (a sequence's salt; ``None`` is one tenant too) has a
   decayed counter ``U``. After every step, each scheduled sequence adds the tokens it
   computed (a prefill chunk's tokens; cached tokens cost nothing; a decode counts
   ``decode_weight``), then every counter is multiplied by
   ``0.5 ** (step_tokens / half_life_tokens)``. The clock is work done, not wall
   time: the order is deterministic, and a tenant that stopped sending recovers its
   priority as others are served. Counters below ``FORGET_BELOW`` are dropped.
2. **Order.** Before each step the waiting queue is sorted, stably, by its tenants'
   ``U``, lowest first: arrival order within a tenant (a preempted sequence, put at
   the head, stays ahead of its tenant's others) and among tenants of equal usage.
   With one tenant waiting the queue is left as it is. The scheduler's short-prefill
   rule then moves short prefills ahead (:mod:`engine.scheduler`).
3. **Interjection.** Every step runs a layer at a time
   (:class:`engine.runner.StagedForward`; not a step the runner would replay as a
   CUDA graph). Between two layers the engine takes in new requests and the
   scheduler may admit, as a step of their own that runs to its sampled token before
   the running step resumes, waiting sequences that

   * need at most the scheduler's ``short_prefill_tokens`` uncomputed tokens after
     their cached prefix,
   * belong to a tenant whose ``U`` is below the lowest ``U`` among the *other*
     tenants with work in the running step (a lighter tenant; its own earlier
     request may be decoding in that step: it has no say over the step's length;
     with one tenant nothing ever interjects, so single-tenant scheduling is
     unchanged),
   * fit without preempting anyone or taking others' reserved blocks,

   at most ``max_interjected_tokens`` tokens in all per running step. A short
   request's wait for a running step is then one layer of it (~1/30), not the step.
   Steps are staged only while at least two tenants have a usage counter (work
   within the last few half-lives): a worker serving one tenant runs every step
   whole, as before (a layer-at-a-time step cost it 1-2% of its throughput), and a
   second tenant's first request waits for the running step like any other.

Parameters (:class:`FairnessConfig`): ``enabled`` (False: arrival order, no
interjection: the scheduler of before), ``half_life_tokens`` (8192),
``decode_weight`` (1.0), ``max_interjected_tokens`` (256), ``layers_per_stage`` (1).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Protocol, TypeVar

FORGET_BELOW = 1e-3  # tokens: a counter this small is as good as none


@dataclass(frozen=True)
class FairnessConfig:
    """Parameters of the tenant-fair policy (see the module docstring)."""

    enabled: bool = True
    half_life_tokens: int = 8192
    decode_weight: float = 1.0
    max_interjected_tokens: int = 256
    layers_per_stage: int = 1

    def __post_init__(self) -> None:
        for name in ("half_life_tokens", "max_interjected_tokens", "layers_per_stage"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.decode_weight < 0:
            raise ValueError(f"decode_weight must be >= 0, got {self.decode_weight}")


class HasTenant(Protocol):
    @property
    def salt(self) -> Hashable: ...


S = TypeVar("S", bound=HasTenant)


class TenantUsage:
    """Decayed per-tenant token counters, the fair order and the interjection test."""

    def __init__(self, config: FairnessConfig | None = None) -> None:
        self.config = config or FairnessConfig()
        self._usage: dict[Hashable, float] = {}

    def usage(self, tenant: Hashable) -> float:
        return self._usage.get(tenant, 0.0)

    @property
    def num_tenants(self) -> int:
        """Tenants with a usage counter (they computed tokens recently)."""
        return len(self._usage)

    def account(self, computed: Iterable[tuple[Hashable, int]]) -> None:
        """A step ran: ``(tenant, tokens computed)`` per scheduled sequence (1 token =
        a decode, weighted ``decode_weight``); then every counter decays by the step's
        work."""
        step_tokens = 0
        for tenant, n in computed:
            step_tokens += n
            weight = self.config.decode_weight if n == 1 else 1.0
            self._usage[tenant] = self._usage.get(tenant, 0.0) + weight * n
        if not step_tokens:
            return
        factor = 0.5 ** (step_tokens / self.config.half_life_tokens)
        for tenant in list(self._usage):
            value = self._usage[tenant] * factor
            if value < FORGET_BELOW:
                del self._usage[tenant]
            else:
                self._usage[tenant] = value

    def order(self, waiting: deque[S]) -> deque[S]:
        """``waiting`` sorted stably by its tenants' usage, lowest first; the same
        deque when disabled or when one tenant (or none) waits."""
        if not self.config.enabled or len(waiting) < 2:
            return waiting
        first = waiting[0].salt
        if all(s.salt == first for s in waiting):
            return waiting
        return deque(sorted(waiting, key=lambda s: self.usage(s.salt)))

    def may_interject(self, tenant: Hashable, step_tenants: AbstractSet[Hashable]) -> bool:
        """Whether ``tenant``'s short prefill may run inside a step of ``step_tenants``'
        work: it is lighter than every other tenant there (and there is one)."""
        others = [t for t in step_tenants if t != tenant]
        if not self.config.enabled or not others:
            return False
        return self.usage(tenant) < min(self.usage(t) for t in others)
