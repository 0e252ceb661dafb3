"""Counting a request's prompt tokens for admission, rate limits and metering.

With the upstream's tokenizer (the in-process engine, or the workers' tokenizer
loaded by the gateway) the count is exact and the ids are those the engine itself
would make (the same chat-message mapping and special tokens, from
:mod:`engine.api.convert`): the in-process engine takes them as they are (no
second tokenization) and the prefix router hashes them like the workers do. Without one (remote
OpenAI-compatible servers) it is an estimate: ``ceil(utf8_bytes / 4)`` per text plus
``4`` per chat message for the template; the upstream's own usage is what gets billed
whenever it reports one.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.api import Tokenizer
from engine.api.convert import chat_messages, text_prompt_ids
from kvtoll.openai.protocol import ChatCompletionRequest, CompletionRequest, OpenAIRequest

BYTES_PER_TOKEN_ESTIMATE = 4
TEMPLATE_TOKENS_PER_MESSAGE = 4


@dataclass(frozen=True)
class PromptCount:
    num_tokens: int
    token_ids: tuple[int, ...] | None  # exact ids of a single prompt, when known
    exact: bool


def _estimate(text: str) -> int:
    return -(-len(text.encode("utf-8")) // BYTES_PER_TOKEN_ESTIMATE)


class PromptCounter:
    """Counts prompt tokens with a tokenizer when given one, else estimates."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self._tokenizer = tokenizer

    def count(self, request: OpenAIRequest) -> PromptCount:
        """The prompt size of ``request`` (see module doc)."""
        if isinstance(request, ChatCompletionRequest):
            return self._count_chat(request)
        return self._count_completion(request)

    def _count_chat(self, request: ChatCompletionRequest) -> PromptCount:
        messages = chat_messages(request)
        if self._tokenizer is not None:
            ids = tuple(self._tokenizer.apply_chat_template(messages))
            return PromptCount(len(ids), ids, True)
        total = sum(_estimate(str(m["content"])) + TEMPLATE_TOKENS_PER_MESSAGE for m in messages)
        return PromptCount(total, None, False)

    def _count_completion(self, request: CompletionRequest) -> PromptCount:
        prompts = request.prompts()
        counts: list[tuple[int, ...] | int] = []
        for prompt in prompts:
            if isinstance(prompt, list):
                counts.append(tuple(prompt))
            elif self._tokenizer is not None:
                counts.append(text_prompt_ids(self._tokenizer, prompt))
            else:
                counts.append(_estimate(prompt))
        exact = all(isinstance(c, tuple) for c in counts)
        total = sum(len(c) if isinstance(c, tuple) else c for c in counts)
        single = counts[0] if len(counts) == 1 and isinstance(counts[0], tuple) else None
        return PromptCount(total, single, exact)
