"""Continuous batching with chunked prefill and preemption by recompute.

A request enters through :meth:`Scheduler.add_request`, which splits it into its
choices (:mod:`engine.fanout`: choice 0 queues now, the others once it has computed
the prompt). Policy, each step, with a token budget of ``max_num_batched_tokens``:

1. Running sequences, oldest first, each get ``min(uncomputed tokens, budget left)``
   tokens: 1 for a decode, a chunk for an unfinished prefill. If the KV pool cannot
   hold them, the *youngest* running sequence is preempted (blocks freed, progress
   forgotten, put back at the head of the waiting queue) until it can; a sequence
   that has to preempt itself stops the pass.
2. If nobody was preempted, waiting sequences are admitted first-come first-served
   while budget, ``max_num_seqs`` and blocks last, each starting from its longest
   cached prefix (see :class:`KVCacheManager.find_prefix`). No skipping: when the
   head does not fit, admission stops. A waiting sequence may take another tenant's
   reserved cached blocks only when nothing runs (running sequences always may), and
   while others run it is admitted only if its whole prompt fits beside the
   reservations and the running sequences' remaining needs; so reservations bound the
   cache, not admission, and running prefills rarely have to break into them.

3. Short prefills first (``short_prefill_tokens`` = S > 0): a waiting sequence whose
   prompt needs at most S uncomputed tokens after its cached prefix (a prefix-cache hit
   with a short new part, e.g. the next turn of a conversation) is admitted ahead of the
   queue, and while one is admitted or still prefilling, the step leaves out longer
   prefill chunks (running ones and admissions; decodes still run), so a cached request
   is not stuck behind another tenant's long prefills in the same step. A long prefill
   is left out at most ``max_deferrals`` steps in a row, then it runs regardless.

4. Tenant-fair order and interjection (:mod:`engine.tenant_fair`): before each step
   the waiting queue is ordered by its tenants' decayed usage (lightest first, stable);
   :meth:`Scheduler.schedule_interjection` admits a lighter tenant's short prefills as
   a step of their own between two layers of a running step of other tenants.

Progress is guaranteed: admission guarantees every sequence fits in an empty cache,
and the oldest running sequence can always preempt everyone younger.

The scheduler is the only writer of a sequence's progress (``num_computed_tokens``):
:meth:`Scheduler.update_from_output` advances it after a step ran, and preemption
resets it. Neither the KV manager, the runner nor the engine writes it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.api import GenerationRequest
from engine.fanout import FanOut
from engine.kv.free_queue import KVBlock
from engine.kv.hashing import TenantSalt
from engine.kv.kv_manager import KVCacheManager
from engine.sequence import SeqStatus, Sequence
from engine.tenant_fair import FairnessConfig, TenantUsage
from kvtoll.openai.responses import TierCachedTokens


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's share of a step, fixed when the step is scheduled."""

    seq: Sequence
    start: int  # tokens already in the KV cache before this step (a prefix hit included)
    num_new_tokens: int
    completes: bool  # after this step all of its tokens are computed: it samples one


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledSeq, ...]
    preempted: tuple[Sequence, ...]

    @property
    def completing(self) -> tuple[Sequence, ...]:
        """The sequences that sample a token in this step, in batch order."""
        return tuple(s.seq for s in self.scheduled if s.completes)


class Scheduler:
    """Decides, each step, which sequences run and with how many tokens."""

    def __init__(
        self,
        kv: KVCacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        short_prefill_tokens: int = 0,
        max_deferrals: int = 8,
        fairness: FairnessConfig | None = None,
    ) -> None:
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.short_prefill_tokens = short_prefill_tokens
        self.max_deferrals = max_deferrals
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.fan_out = FanOut()
        self.fair = TenantUsage(fairness)

    def add_request(self, request: GenerationRequest) -> list[Sequence]:
        """All of the request's choices; choice 0 joins the tail of the waiting queue,
        the others are held until it has computed the prompt (:mod:`engine.fanout`)."""
        choices = self.fan_out.split(request)
        choices[0].status = SeqStatus.WAITING
        self.waiting.append(choices[0])
        return choices

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch (may preempt); allocates the blocks it needs."""
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        self.waiting = self.fair.order(self.waiting)
        short = self._short_step()
        budget = self._schedule_running(scheduled, preempted, short)
        if not preempted:
            self._admit_waiting(scheduled, budget, short)
        if short and not scheduled and not preempted:  # the short one did not fit: run the rest
            budget = self._schedule_running(scheduled, preempted, False)
            if not preempted:
                self._admit_waiting(scheduled, budget, False)
        return SchedulerOutput(tuple(scheduled), tuple(preempted))

    def _is_short(self, seq: Sequence) -> bool:
        """Whether ``seq``'s prefill left (after its cached prefix, if waiting) is short."""
        left = seq.num_uncomputed_tokens
        if left <= self.short_prefill_tokens:
            return True
        if seq.status is not SeqStatus.WAITING or seq.num_computed_tokens:
            return False
        cached = len(self.kv.find_prefix(seq)) * self.kv.block_size
        return left - cached <= self.short_prefill_tokens

    def _short_step(self) -> bool:
        """Move short waiting prefills to the head of the queue (stable); whether this
        step is a short one (some short prefill runs or is admitted)."""
        if self.short_prefill_tokens <= 0:
            return False
        flags = [self._is_short(s) for s in self.waiting]
        short_waiting = [s for s, short in zip(self.waiting, flags, strict=True) if short]
        if short_waiting and len(short_waiting) < len(self.waiting):
            rest = [s for s, short in zip(self.waiting, flags, strict=True) if not short]
            self.waiting = deque(short_waiting + rest)
        return bool(short_waiting) or any(
            1 < s.num_uncomputed_tokens <= self.short_prefill_tokens for s in self.running
        )

    def _defer(self, seq: Sequence, short: bool) -> bool:
        """Leave a long prefill out of a short step (at most ``max_deferrals`` in a row)."""
        if not short or seq.num_uncomputed_tokens <= self.short_prefill_tokens:
            seq.num_deferrals = 0
            return False
        if seq.num_deferrals >= self.max_deferrals:
            seq.num_deferrals = 0
            return False
        seq.num_deferrals += 1
        return True

    def _schedule_running(
        self, scheduled: list[ScheduledSeq], preempted: list[Sequence], short: bool
    ) -> int:
        budget = self.max_num_batched_tokens
        idx = 0
        while idx < len(self.running) and budget > 0:
            seq = self.running[idx]
            if self._defer(seq, short):
                idx += 1
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            while not self.kv.can_allocate(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    return budget
            self.kv.allocate_slots(seq, n)
            scheduled.append(self._scheduled(seq, seq.num_computed_tokens, n))
            budget -= n
            idx += 1
        return budget

    def _admit_waiting(self, scheduled: list[ScheduledSeq], budget: int, short: bool) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if short and not self._is_short(seq):
                return
            prefix = self.kv.find_prefix(seq) if seq.num_computed_tokens == 0 else []
            if self.running and not self._fits_beside_reservations(seq, prefix):
                return
            start = seq.num_computed_tokens + len(prefix) * self.kv.block_size
            n = min(seq.num_tokens - start, budget)
            if not self.kv.allocate_slots(seq, n, prefix, use_reserved=not self.running):
                return
            self.waiting.popleft()
            self._start_running(seq, prefix)
            scheduled.append(self._scheduled(seq, start, n))
            budget -= n

    def _start_running(self, seq: Sequence, prefix: list[KVBlock]) -> None:
        """``seq`` (off the waiting queue, its slots allocated) joins the running batch;
        on its first admission, how many prompt tokens the cache (and tier 2) gave it."""
        loaded = self.kv.take_tier_loaded(seq)
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = len(prefix) * self.kv.block_size
            if loaded is not None:
                bs = self.kv.block_size
                seq.tier_cached_tokens = TierCachedTokens(
                    loaded.host_blocks * bs, loaded.shared_blocks * bs
                ).clamped(seq.num_cached_tokens)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def step_tenants(self, out: SchedulerOutput) -> set[TenantSalt | None]:
        """The tenants with work in ``out``, which another tenant's interjection may
        enter (empty: nothing may, run it whole; so while only one tenant has worked
        recently, :mod:`engine.tenant_fair` rule 3)."""
        if (self.short_prefill_tokens <= 0 or not self.fair.config.enabled
                or self.fair.num_tenants < 2):
            return set()
        return {s.seq.salt for s in out.scheduled}

    def schedule_interjection(
        self, step_tenants: set[TenantSalt | None], max_tokens: int
    ) -> SchedulerOutput:
        """A step to run between two layers of a running step of ``step_tenants``' work
        (:mod:`engine.tenant_fair`, rule 3): waiting short prefills
        of lighter tenants, in fair order, at most ``max_tokens`` tokens, each only if it
        fits without preempting or taking reserved blocks. Running sequences are not
        touched: the running step owns their progress until it is accounted for."""
        scheduled: list[ScheduledSeq] = []
        for seq in list(self.waiting):
            if len(self.running) >= self.max_num_seqs or max_tokens <= 0:
                break
            if not self.fair.may_interject(seq.salt, step_tenants) or not self._is_short(seq):
                continue
            prefix = self.kv.find_prefix(seq) if seq.num_computed_tokens == 0 else []
            start = seq.num_computed_tokens + len(prefix) * self.kv.block_size
            n = seq.num_tokens - start
            if n > max_tokens or not self._fits_beside_reservations(seq, prefix):
                continue
            if not self.kv.allocate_slots(seq, n, prefix, use_reserved=False):
                continue
            self.waiting.remove(seq)
            self._start_running(seq, prefix)
            scheduled.append(self._scheduled(seq, start, n))
            max_tokens -= n
        return SchedulerOutput(tuple(scheduled), ())

    def _fits_beside_reservations(self, seq: Sequence, prefix: list[KVBlock]) -> bool:
        """With reservations set, whether ``seq``'s whole prompt fits in blocks that are
        not other tenants' reservations once every running sequence has the blocks its
        own tokens still need (prefill chunks allocate as they go, so admitting on the
        first chunk alone would later push running sequences into the reservations)."""
        pool = self.kv.pool
        if not pool.tenants.any_reserved:
            return True
        kv = self.kv
        outstanding = sum(
            max(0, kv.num_blocks_for(s.num_tokens) - len(kv.block_ids(s.seq_id)))
            for s in self.running
        )
        revived = sum(1 for b in prefix if b.ref_cnt == 0)
        need = kv.num_blocks_for(seq.num_tokens) - len(prefix) + revived
        return need + outstanding <= pool.num_available(seq.salt, use_reserved=False)

    @staticmethod
    def _scheduled(seq: Sequence, start: int, n: int) -> ScheduledSeq:
        return ScheduledSeq(seq, start, n, completes=start + n == seq.num_tokens)

    def _preempt(self, seq: Sequence) -> None:
        """Free the blocks and forget the progress: prompt and outputs so far are
        re-prefilled when the sequence is admitted again."""
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def update_from_output(self, out: SchedulerOutput) -> None:
        """Account for a step that ran: the only place progress advances.

        Call after the engine appended each completing sequence's sampled token and
        decided whether it finished (``finish_reason``). Each scheduled sequence's
        ``num_computed_tokens`` becomes ``start + num_new_tokens``; finished ones
        register their full blocks in the prefix cache and release them, then the
        others register their newly full blocks; held choices of a sequence that has
        just computed its prompt join the waiting queue.
        """
        for s in out.scheduled:
            if s.seq.num_computed_tokens > s.start:
                raise RuntimeError(f"seq {s.seq.seq_id}: progress moved outside the scheduler")
            s.seq.num_computed_tokens = s.start + s.num_new_tokens
        self.fair.account((s.seq.salt, s.num_new_tokens) for s in out.scheduled)
        for seq in out.completing:
            if seq.finish_reason is not None:
                self.kv.cache_full_blocks(seq)
                self.finish(seq)
        for s in out.scheduled:
            if not s.seq.is_finished:
                self.kv.cache_full_blocks(s.seq)
        for seq in out.completing:
            self._release_held(seq)

    def _release_held(self, seq: Sequence) -> None:
        """``seq`` has computed its prompt: its held sibling choices join the head of the
        waiting queue, in order."""
        for held in reversed(self.fan_out.release(seq)):
            held.status = SeqStatus.WAITING
            self.waiting.appendleft(held)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence (running, waiting or held) and free its
        blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        else:
            self.fan_out.drop(seq)
        self.kv.free(seq)
        seq.status = SeqStatus.FINISHED
