"""Admission limits: prompt tokens, ``max_tokens`` and ``n`` (body size is capped while
reading, by :func:`kvtoll.openai.errors.read_body_bytes`).

Checked after schema validation (the serving protocol models) and before any cache
or upstream sees the request. Every refusal is a caller's mistake and raises
:class:`AdmissionError` (HTTP 400) naming the offending field.
Limits come from :class:`proxy.config.AdmissionLimits`; the prompt limit is further
capped by the upstream's context length when the proxy knows it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtoll.openai.errors import OpenAIError
from proxy.config import AdmissionLimits


class AdmissionError(OpenAIError):
    """A request outside the limits (400), in OpenAI's error shape."""

    def __init__(
        self, message: str, *, param: str | None = None, code: str = "invalid_value"
    ) -> None:
        super().__init__(message, param=param, code=code)


@dataclass(frozen=True)
class Admitted:
    """What admission settled: the token budget of one request."""

    prompt_tokens: int
    max_tokens: int
    n: int

    @property
    def cost_tokens(self) -> int:
        """Tokens charged to the tokens-per-minute limit: prompt + the most it can generate."""
        return self.prompt_tokens + self.max_tokens * self.n


def admit(
    prompt_token_ids: Sequence[int] | int,
    max_tokens: int | None,
    n: int | None,
    limits: AdmissionLimits,
    *,
    context_len: int | None = None,
) -> Admitted:
    """Check the token budget; ``prompt_token_ids`` may be a bare count when estimated."""
    num_prompt = prompt_token_ids if isinstance(prompt_token_ids, int) else len(prompt_token_ids)
    choices = 1 if n is None else n
    if choices < 1 or choices > limits.max_n:
        raise AdmissionError(f"n must be between 1 and {limits.max_n}", param="n")
    wanted = limits.default_max_tokens if max_tokens is None else max_tokens
    if wanted < 1 or wanted > limits.max_tokens_cap:
        raise AdmissionError(
            f"max_tokens must be between 1 and {limits.max_tokens_cap}", param="max_tokens"
        )
    prompt_cap = limits.max_prompt_tokens
    if context_len is not None:
        prompt_cap = min(prompt_cap, context_len - 1)
    if num_prompt > prompt_cap:
        raise AdmissionError(
            f"prompt has {num_prompt} tokens, more than the limit of {prompt_cap}",
            param="messages", code="context_length_exceeded",
        )
    if context_len is not None and max_tokens is None:
        wanted = max(1, min(wanted, context_len - num_prompt))
    if context_len is not None and num_prompt + wanted > context_len:
        raise AdmissionError(
            f"prompt ({num_prompt} tokens) + max_tokens ({wanted}) exceeds the context"
            f" length of {context_len}", param="max_tokens", code="context_length_exceeded",
        )
    return Admitted(prompt_tokens=num_prompt, max_tokens=wanted, n=choices)
