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
   head does not fit, admission stops.

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
from engine.kv.kv_manager import KVCacheManager
from engine.sequence import SeqStatus, Sequence
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

    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.fan_out = FanOut()

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
        budget = self._schedule_running(scheduled, preempted)
        if not preempted:
            self._admit_waiting(scheduled, budget)
        return SchedulerOutput(tuple(scheduled), tuple(preempted))

    def _schedule_running(self, scheduled: list[ScheduledSeq], preempted: list[Sequence]) -> int:
        budget = self.max_num_batched_tokens
        idx = 0
        while idx < len(self.running) and budget > 0:
            seq = self.running[idx]
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

    def _admit_waiting(self, scheduled: list[ScheduledSeq], budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            prefix = self.kv.find_prefix(seq) if seq.num_computed_tokens == 0 else []
            start = seq.num_computed_tokens + len(prefix) * self.kv.block_size
            n = min(seq.num_tokens - start, budget)
            if not self.kv.allocate_slots(seq, n, prefix):
                return
            self.waiting.popleft()
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
            scheduled.append(self._scheduled(seq, start, n))
            budget -= n

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
