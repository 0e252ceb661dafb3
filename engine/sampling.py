"""Token sampling from float32 logits, one row per sequence.

Greedy when ``temperature`` is below ``GREEDY_BELOW_TEMPERATURE`` (0 included);
otherwise logits / temperature, then top-k (keep
the k largest), then top-p (keep the smallest set of tokens whose probability mass
reaches p), then a draw from the sequence's own ``torch.Generator`` (seeded from
``seed + choice index`` when the request has a seed, so results are reproducible).
Logprobs are those of the unmodified model distribution.
"""

from __future__ import annotations

import os

import torch

from engine.api import SamplingParams, TokenLogprob


def make_generator(params: SamplingParams, index: int) -> torch.Generator | None:
    """The per-choice generator (None for greedy)."""
    if is_greedy(params):
        return None
    seed = (
        params.seed + index if params.seed is not None else int.from_bytes(os.urandom(8), "little")
    )
    return torch.Generator().manual_seed(seed % (1 << 63))


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) everything outside top-k and top-p for one row [V]."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        drop = mass_before >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


# Below this temperature sampling is greedy: dividing logits by a tiny temperature
# overflows to inf and NaN probabilities would fail the whole engine step.
GREEDY_BELOW_TEMPERATURE = 1e-5


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_BELOW_TEMPERATURE


def sample_row(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """One token id from one row of logits [V]."""
    if is_greedy(params) or gen is None:
        return int(greedy_tokens(logits))
    row = filter_logits(logits / params.temperature, params.top_k, params.top_p)
    probs = row.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=gen))


def token_logprob(logits: torch.Tensor, token_id: int, top: int) -> TokenLogprob:
    """Logprob of ``token_id`` and the ``top`` most likely tokens, from raw logits [V]."""
    lp = logits.log_softmax(-1)
    pairs: tuple[tuple[int, float], ...] = ()
    if top > 0:
        vals, ids = torch.topk(lp, top)
        pairs = tuple((int(i), float(v)) for i, v in zip(ids, vals, strict=True))
    return TokenLogprob(token_id=token_id, logprob=float(lp[token_id]), top=pairs)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest logit (the first among equals; a NaN wins, as in
    ``torch.argmax``). ``max(dim=-1).indices`` gives the same indices as ``argmax`` and
    ran ~3x faster on CPU at the LM head's width (64 x 49,152 float32: 0.66 vs 1.9 ms at
    2 threads), which was 4% of a 64-request decode step."""
    return logits.max(dim=-1).indices


def sample_batch(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> tuple[list[int], list[TokenLogprob | None]]:
    """Sample one token per row of ``logits`` [S, V]; logprobs where requested."""
    greedy = greedy_tokens(logits).tolist()
    tokens: list[int] = []
    logprobs: list[TokenLogprob | None] = []
    for i, (p, g) in enumerate(zip(params, generators, strict=True)):
        tok = int(greedy[i]) if is_greedy(p) or g is None else sample_row(logits[i], p, g)
        tokens.append(tok)
        logprobs.append(
            token_logprob(logits[i], tok, p.logprobs) if p.logprobs is not None else None
        )
    return tokens, logprobs
