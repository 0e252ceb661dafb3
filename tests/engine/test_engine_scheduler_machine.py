"""Property test of the scheduler without a model: random requests (n choices, shared
prompt stems), steps with fake sampled tokens and finishes, and aborts.

Checked each step: ``schedule()`` moves no sequence's progress except a preempted
one's (reset to 0); ``update_from_output`` sets exactly the scheduled sequences'
progress to ``start + num_new_tokens``; budgets, queues, block tables and held
choices stay consistent; a step with work always schedules something.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from engine.api import FinishReason, GenerationRequest, SamplingParams
from engine.kv.block_pool import BlockPool
from engine.kv.kv_manager import KVCacheManager
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import SeqStatus, Sequence

BS = 4
NUM_BLOCKS = 7  # a sequence needs at most 6 blocks (13 + 10 tokens)
BUDGET = 8
MAX_SEQS = 4
STEMS = ((1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 9, 9), (5, 5, 5, 5, 5))


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(BlockPool(NUM_BLOCKS, BS))
        self.sched = Scheduler(self.kv, BUDGET, MAX_SEQS)
        self.requests: dict[str, list[Sequence]] = {}
        self.num_requests = 0

    def _live(self) -> list[Sequence]:
        return [s for seqs in self.requests.values() for s in seqs if not s.is_finished]

    @rule(
        stem=st.sampled_from(STEMS),
        tail=st.lists(st.integers(0, 3), max_size=5),
        n=st.integers(1, 3),
        max_tokens=st.integers(1, 10),
    )
    def add(self, stem: tuple[int, ...], tail: list[int], n: int, max_tokens: int) -> None:
        rid = f"r{self.num_requests}"
        self.num_requests += 1
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, n=n)
        choices = self.sched.add_request(GenerationRequest(rid, (*stem, *tail), params))
        assert [c.index for c in choices] == list(range(n))
        assert list(self.sched.waiting).count(choices[0]) == 1
        assert not any(c in self.sched.waiting for c in choices[1:])  # held
        self.requests[rid] = choices

    @rule(data=st.data(), num_steps=st.integers(1, 4))
    def steps(self, data: st.DataObject, num_steps: int) -> None:
        for _ in range(num_steps):
            self._step(data)

    def _step(self, data: st.DataObject) -> None:
        before = {s: s.num_computed_tokens for s in self._live()}
        out = self.sched.schedule()
        self._check_schedule(out, before)
        for seq in out.completing:  # the engine's part: a sampled token, finish checks
            seq.token_ids.append(data.draw(st.integers(0, 3)))
            stop = data.draw(st.integers(0, 11)) == 0  # a stop token, now and then
            if seq.num_output_tokens >= seq.sampling.max_tokens or stop:
                seq.finish_reason = FinishReason.STOP
        self.sched.update_from_output(out)
        moved = {s.seq for s in out.scheduled}
        for s in out.scheduled:
            assert s.seq.num_computed_tokens == s.start + s.num_new_tokens
            assert s.seq.is_finished == (s.seq.finish_reason is not None)
        for seq, progress in before.items():
            if seq not in moved:
                assert seq.num_computed_tokens == (0 if seq in out.preempted else progress)

    def _check_schedule(self, out: SchedulerOutput, before: dict[Sequence, int]) -> None:
        assert out.scheduled or not self.sched.has_work()
        assert sum(s.num_new_tokens for s in out.scheduled) <= BUDGET
        assert len(self.sched.running) <= MAX_SEQS
        for seq, progress in before.items():
            expected = 0 if seq in out.preempted else progress
            assert seq.num_computed_tokens == expected  # schedule() advances nothing
        for s in out.scheduled:
            assert s.num_new_tokens > 0 and s.start >= s.seq.num_computed_tokens
            assert s.completes == (s.start + s.num_new_tokens == s.seq.num_tokens)
            assert len(self.kv.block_ids(s.seq.seq_id)) * BS >= s.start + s.num_new_tokens
        for seq in out.preempted:
            assert seq.status is SeqStatus.WAITING and not self.kv.block_ids(seq.seq_id)
        assert not {s.seq for s in out.scheduled} & set(out.preempted)

    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        if self.requests:
            rid = data.draw(st.sampled_from(sorted(self.requests)))
            for seq in self.requests.pop(rid):
                if not seq.is_finished:
                    self.sched.finish(seq)

    @invariant()
    def queues_hold_what_their_status_says(self) -> None:
        running, waiting = self.sched.running, list(self.sched.waiting)
        assert not set(running) & set(waiting)
        assert all(s.status is SeqStatus.RUNNING for s in running)
        assert all(s.status is SeqStatus.WAITING for s in waiting)
        for seq in waiting:
            assert seq.num_computed_tokens == 0 and not self.kv.block_ids(seq.seq_id)
        for seq in running:
            assert len(self.kv.block_ids(seq.seq_id)) * BS >= seq.num_computed_tokens

    @invariant()
    def choices_are_held_only_until_choice_0_computed_the_prompt(self) -> None:
        queued = set(self.sched.running) | set(self.sched.waiting)
        num_held = 0
        for seqs in self.requests.values():
            held = [s for s in seqs[1:] if s not in queued and not s.is_finished]
            num_held += len(held)
            if held:
                assert seqs[0].num_output_tokens == 0 and not seqs[0].is_finished
                assert all(s.num_tokens == s.num_prompt_tokens for s in held)
                assert not any(self.kv.block_ids(s.seq_id) for s in held)
        assert self.sched.fan_out.num_held() == num_held

    def teardown(self) -> None:
        for seq in self._live():
            self.sched.finish(seq)
        assert not self.sched.has_work() and self.sched.fan_out.num_held() == 0
        assert self.kv.pool.num_free_blocks == NUM_BLOCKS


SchedulerMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=50, deadline=None
)
TestSchedulerMachine = SchedulerMachine.TestCase


class ShortFirstSchedulerMachine(SchedulerMachine):
    """The same invariants with short prefills admitted first and long ones deferred."""

    def __init__(self) -> None:
        super().__init__()
        self.sched = Scheduler(self.kv, BUDGET, MAX_SEQS, short_prefill_tokens=4, max_deferrals=2)


ShortFirstSchedulerMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=50, deadline=None
)
TestShortFirstSchedulerMachine = ShortFirstSchedulerMachine.TestCase
