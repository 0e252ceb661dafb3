"""Per-choice bookkeeping: tokens, progress through prefill, status, outputs.

A :class:`GenerationRequest` with ``n`` choices becomes ``n`` :class:`Sequence`
objects sharing the prompt (:mod:`engine.fanout`); each has its own seeded generator
and detokenizer. The scheduler alone writes progress (``num_computed_tokens``,
status, preemptions); the engine appends sampled tokens and output state; the KV
manager only reads. Nothing here holds tensors besides the per-choice
``torch.Generator``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from engine.api import FinishReason, SamplingParams, TokenLogprob
from engine.detokenize import DetokWindow
from engine.kv.hashing import BlockHash, TenantSalt
from kvtoll.openai.responses import TierCachedTokens


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class DetokState:
    """Incremental detokenization: what was decoded, and what was already sent."""

    window: DetokWindow = field(default_factory=DetokWindow)
    sent_text: str = ""
    sent_num_tokens: int = 0
    logprobs_sent: int = 0


@dataclass(eq=False)
class Sequence:
    """One choice of one request."""

    seq_id: int
    request_id: str
    index: int
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    salt: TenantSalt | None
    arrival: int  # admission order; lower = higher priority
    generator: torch.Generator | None = None
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None  # None until the first admission looked it up
    tier_cached_tokens: TierCachedTokens | None = None  # ... their part tier 2 loaded
    block_hashes: list[BlockHash] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    detok: DetokState = field(default_factory=DetokState)
    num_preemptions: int = 0
    num_deferrals: int = 0  # steps in a row its long prefill was left out (scheduler)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens
