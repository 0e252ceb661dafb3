"""Admission checks: a request that can never run is refused before anything runs.

Every failure raises :class:`EngineRejected` (a ``ValueError``) whose message starts
with the offending parameter's name, e.g. ``"temperature: must be >= 0, got -1"``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.api import EngineRejected, GenerationRequest, SamplingParams
from engine.kv.tenant_shares import check_share


@dataclass(frozen=True)
class Limits:
    max_model_len: int
    max_n: int
    max_logprobs: int
    vocab_size: int
    block_size: int
    num_kv_blocks: int


def _reject(param: str, message: str) -> EngineRejected:
    err = EngineRejected(f"{param}: {message}")
    err.param = param  # type: ignore[attr-defined]
    return err


def validate_sampling(p: SamplingParams, limits: Limits) -> None:
    """Refuse sampling parameters outside their domain."""
    if (
        not (isinstance(p.temperature, int | float) and math.isfinite(p.temperature))
        or p.temperature < 0
    ):
        raise _reject("temperature", f"must be a finite number >= 0, got {p.temperature}")
    if not (isinstance(p.top_p, int | float) and math.isfinite(p.top_p)) or not 0 < p.top_p <= 1:
        raise _reject("top_p", f"must be in (0, 1], got {p.top_p}")
    if p.top_k < 0:
        raise _reject("top_k", f"must be >= 0 (0 = off), got {p.top_k}")
    if not 1 <= p.n <= limits.max_n:
        raise _reject("n", f"must be between 1 and {limits.max_n}, got {p.n}")
    if p.max_tokens < 1:
        raise _reject("max_tokens", f"must be >= 1, got {p.max_tokens}")
    if p.logprobs is not None and not 0 <= p.logprobs <= limits.max_logprobs:
        raise _reject("logprobs", f"must be between 0 and {limits.max_logprobs}, got {p.logprobs}")
    if any(not s for s in p.stop):
        raise _reject("stop", "stop strings must not be empty")


def validate_request(req: GenerationRequest, limits: Limits) -> None:
    """Refuse a request that is malformed or could never fit the context or the cache."""
    validate_sampling(req.sampling, limits)
    n_prompt = len(req.prompt_token_ids)
    if n_prompt == 0:
        raise _reject("prompt", "the prompt is empty")
    bad = [t for t in req.prompt_token_ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise _reject(
            "prompt", f"token id {bad[0]} is outside the vocabulary (0..{limits.vocab_size - 1})"
        )
    if n_prompt >= limits.max_model_len:
        raise _reject(
            "prompt",
            f"{n_prompt} prompt tokens do not fit the context of {limits.max_model_len} tokens "
            "(at least one token must be generated)",
        )
    total = n_prompt + req.sampling.max_tokens
    if total > limits.max_model_len:
        raise _reject(
            "max_tokens",
            f"{n_prompt} prompt tokens + max_tokens {req.sampling.max_tokens} = {total} exceed the "
            f"context of {limits.max_model_len} tokens",
        )
    if req.kv_share is not None:
        try:
            check_share(req.kv_share, limits.num_kv_blocks)
        except ValueError as exc:
            raise _reject("kvtoll_kv_share", str(exc)) from None
    blocks = -(-total // limits.block_size)
    if blocks > limits.num_kv_blocks:
        raise _reject(
            "max_tokens",
            f"prompt + max_tokens need {blocks} KV blocks; the cache has only "
            f"{limits.num_kv_blocks}",
        )
