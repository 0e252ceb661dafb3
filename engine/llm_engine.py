"""Synchronous engine: add requests, call :meth:`LLMEngine.step` until done.

One step = schedule -> run the model on the batch -> sample -> append the tokens and
check for finishes -> the scheduler accounts for the step (advances progress, registers
newly full blocks in the prefix cache, frees finished sequences, releases held
choices). Not thread-safe: :class:`engine.async_engine.AsyncEngine` drives it from one
thread.

With :class:`StepHooks` (the async engine's), a step runs a layer at a time, and
between layers new requests come in and a lighter tenant's short prefills (of a
tenant with nothing in the step) run as steps of their own, their chunks delivered
at once (:mod:`engine.tenant_fair`)::

    step: L0 L1 L2 | poll; interjected step: prefill, sample, deliver | L3 ... L29, sample
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import TYPE_CHECKING, Protocol

from engine.api import (
    EngineLoad,
    FinishReason,
    GenerationChunk,
    GenerationRequest,
    KVEvent,
    Tokenizer,
    TokenLogprob,
)
from engine.kernels.cpu_fused import argmax_rows
from engine.kv.kv_manager import KVCacheManager
from engine.output import OutputProcessor
from engine.runner import ModelRunner, RunnerSeq
from engine.sampling import greedy_tokens, sample_batch
from engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from engine.sequence import Sequence
from engine.validation import Limits, validate_request

if TYPE_CHECKING:
    import torch

    from engine.kv.hashing import TenantSalt
    from engine.kv.tier.tier import KVTier

log = logging.getLogger(__name__)


class StepHooks(Protocol):
    """What a step may call between two of its layers (the step thread's owner
    implements it)."""

    def poll(self) -> bool:
        """Take in requests that arrived (:meth:`LLMEngine.add_request`); aborts wait
        until the step has been accounted for. Whether any op came in."""

    def deliver(self, chunks: list[GenerationChunk]) -> None:
        """Send an interjected step's chunks to their callers now."""


class LLMEngine:
    """Scheduler + KV manager + model runner behind a step() loop."""

    def __init__(
        self,
        model_name: str,
        tokenizer: Tokenizer,
        runner: ModelRunner,
        kv: KVCacheManager,
        scheduler: Scheduler,
        limits: Limits,
        dtype: str = "float32",
        tier: KVTier | None = None,
    ) -> None:
        self.model_name = model_name
        self.dtype = dtype  # the model's and KV cache's floating-point type
        self.tier = tier  # tier 2 (engine.kv.tier); None: off
        self.tokenizer = tokenizer
        self.runner = runner
        self.kv = kv
        self.scheduler = scheduler
        self.limits = limits
        self.outputs = OutputProcessor(tokenizer, limits.max_model_len)
        self._requests: dict[str, list[Sequence]] = {}
        self.num_preemptions = 0  # total, for tests and metrics
        self.num_steps = 0
        self.num_interjections = 0  # steps run inside another step (engine.tenant_fair)
        # greedy picks: the fused CPU kernels' argmax where the runner has them (0.31 ms
        # for a 64-row step's float32 logits against torch's 0.84), else torch's
        fused = runner.fused
        self._greedy = greedy_tokens if fused is None else partial(argmax_rows, fused)

    @property
    def block_size(self) -> int:
        return self.kv.block_size

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    def validate(self, request: GenerationRequest) -> None:
        """Raise :class:`EngineRejected` if the request can never run."""
        validate_request(request, self.limits)

    def add_request(self, request: GenerationRequest) -> None:
        """Validate and queue a request: the scheduler splits it into its ``n`` choices
        (see :mod:`engine.fanout` for how choices after the first share the prompt)."""
        self.validate(request)
        if request.request_id in self._requests:
            raise ValueError(f"request_id: {request.request_id!r} is already running")
        if request.kv_share is not None:
            self.kv.pool.set_share(request.salt, request.kv_share)
        self._requests[request.request_id] = self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> list[GenerationChunk]:
        """Stop a request now and free its blocks; the final ``abort`` chunks."""
        chunks: list[GenerationChunk] = []
        for seq in self._requests.pop(request_id, []):
            if seq.is_finished:
                continue
            self.scheduler.finish(seq)
            seq.finish_reason = FinishReason.ABORT
            chunk = self.outputs.chunk(seq, seq.detok.sent_text, seq.num_prompt_tokens)
            if chunk is not None:
                chunks.append(chunk)
        return chunks

    def abort_all(self) -> list[GenerationChunk]:
        """Abort every request (used when a step failed); their final chunks."""
        return [c for rid in list(self._requests) for c in self.abort_request(rid)]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self, hooks: StepHooks | None = None) -> list[GenerationChunk]:
        """Run one scheduling step; the chunks it produced (with ``hooks``, chunks of
        steps interjected into it went out through ``hooks.deliver`` already)."""
        return self.execute(self.scheduler.schedule(), hooks)

    def execute(
        self, out: SchedulerOutput, hooks: StepHooks | None = None
    ) -> list[GenerationChunk]:
        """Run a batch the scheduler picked: model, sampling, finish checks; then the
        scheduler accounts for the step (progress, prefix caching, freeing)."""
        self.num_preemptions += len(out.preempted)
        if not out.scheduled:
            return []
        self.num_steps += 1
        if self.tier is not None:
            self.tier.flush()  # evicted blocks are copied before this step reuses them
        t0 = time.perf_counter()
        batch = [self._runner_seq(s) for s in out.scheduled]
        tenants = self.scheduler.step_tenants(out) if hooks is not None else set()
        inner_s = 0.0  # time spent in interjected steps (they observe their own)
        if tenants and hooks is not None and self.runner.stages(batch):
            logits, inner_s = self._run_interruptible(batch, tenants, hooks)
        else:
            logits = self.runner.execute(batch)
        completing = out.completing
        tokens, logprobs = sample_batch(
            logits, [s.sampling for s in completing], [s.generator for s in completing],
            self._greedy,
        )
        if self.tier is not None:
            num_tokens = sum(s.num_new_tokens for s in out.scheduled)
            self.tier.observe_step(num_tokens, time.perf_counter() - t0 - inner_s)
        chunks: list[GenerationChunk] = []
        for seq, tok, lp in zip(completing, tokens, logprobs, strict=True):
            chunk = self._append_token(seq, tok, lp)
            if chunk is not None:
                chunks.append(chunk)
        self.scheduler.update_from_output(out)
        self._forget_finished(completing)
        return chunks

    def _run_interruptible(
        self, batch: list[RunnerSeq], tenants: set[TenantSalt | None], hooks: StepHooks
    ) -> tuple[torch.Tensor, float]:
        """The step's forward a stage of layers at a time; between stages, arrivals
        come in and the scheduler's interjections run whole (sampled, delivered).
        The logits, and the seconds the interjected steps took."""
        forward = self.runner.start(batch)
        fair = self.scheduler.fair.config
        allowance = fair.max_interjected_tokens
        inner_s = 0.0
        look = True  # the waiting queue as it stands, then after each arrival
        while forward.advance(fair.layers_per_stage):
            if allowance <= 0:
                continue
            look = hooks.poll() or look
            if not look or not self.scheduler.waiting:
                continue
            look = False
            inner = self.scheduler.schedule_interjection(tenants, allowance)
            if inner.scheduled:
                self.num_interjections += 1
                allowance -= sum(s.num_new_tokens for s in inner.scheduled)
                t0 = time.perf_counter()
                hooks.deliver(self.execute(inner))
                inner_s += time.perf_counter() - t0
        return forward.logits(), inner_s

    def _runner_seq(self, s: ScheduledSeq) -> RunnerSeq:
        seq = s.seq
        return RunnerSeq(
            token_ids=tuple(seq.token_ids[s.start : s.start + s.num_new_tokens]),
            start=s.start,
            block_ids=self.kv.block_ids(seq.seq_id),
            needs_logits=s.completes,
        )

    def _append_token(
        self, seq: Sequence, tok: int, lp: TokenLogprob | None
    ) -> GenerationChunk | None:
        """The sampled token joins the sequence; the finish check and the chunk to emit."""
        seq.token_ids.append(tok)
        if lp is not None:
            seq.logprobs.append(lp)
        return self.outputs.process(seq, seq.num_prompt_tokens)

    def _forget_finished(self, seqs: tuple[Sequence, ...]) -> None:
        for seq in seqs:
            choices = self._requests.get(seq.request_id, [])
            if seq.is_finished and all(s.is_finished for s in choices):
                self._requests.pop(seq.request_id, None)

    def load(self) -> EngineLoad:
        """Queue lengths and free/total KV blocks."""
        return EngineLoad(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_free_blocks=self.kv.pool.num_free_blocks,
            num_total_blocks=self.kv.pool.num_blocks,
            block_size=self.kv.block_size,
            tier_load_fraction=self.tier.shared_load_fraction() if self.tier else None,
            tenants=self.kv.pool.tenants.loads(),
        )

    def kv_events(self, cursor: int, limit: int = 1000) -> list[KVEvent]:
        """Prefix-cache events with ``seq >= cursor``."""
        return self.kv.pool.events.since(cursor, limit)

    def generate_sync(
        self, requests: list[GenerationRequest]
    ) -> dict[str, list[list[GenerationChunk]]]:
        """Run ``requests`` to completion (tests, benchmarks): chunks per request per choice."""
        result: dict[str, list[list[GenerationChunk]]] = {}
        for r in requests:
            self.add_request(r)
            result[r.request_id] = [[] for _ in range(r.sampling.n)]
        while self.has_unfinished():
            for c in self.step():
                result[c.request_id][c.index].append(c)
        return result
