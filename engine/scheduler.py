"""Continuous batching with chunked prefill and preemption by recompute.

Policy, each step, with a token budget of ``max_num_batched_tokens``:

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
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.kv.kv_manager import KVCacheManager
from engine.sequence import SeqStatus, Sequence


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # tokens already in the KV cache before this step
    num_new_tokens: int

    @property
    def completes(self) -> bool:
        """After this step all of the sequence's tokens are computed: sample one."""
        return self.start + self.num_new_tokens == self.seq.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledSeq, ...]
    preempted: tuple[Sequence, ...]


class Scheduler:
    """Decides, each step, which sequences run and with how many tokens."""

    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence at the tail of the waiting queue."""
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def add_first(self, seqs: list[Sequence]) -> None:
        """Queue ``seqs`` at the head of the waiting queue, in order (they arrived with
        a sequence that is already running)."""
        for seq in reversed(seqs):
            seq.status = SeqStatus.WAITING
            self.waiting.appendleft(seq)

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
            start = seq.num_computed_tokens
            self.kv.allocate_slots(seq, n)
            scheduled.append(ScheduledSeq(seq, start, n))
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
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = len(prefix) * self.kv.block_size
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, start, n))
            budget -= n

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = SeqStatus.FINISHED
