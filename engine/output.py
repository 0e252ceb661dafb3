"""Finish checks and incremental detokenization of one sequence's new token.

After each sampled token: stop token ids / EOS (unless ``ignore_eos``) finish with
``stop`` and are not part of the text; a stop string finishes with ``stop`` and the
text is cut before it; ``max_tokens`` or the context limit finish with ``length``.
While running, text that might still change is held back: trailing U+FFFD (an
incomplete UTF-8 character: at most 3 bytes, so at most 3 replacement characters;
older ones are invalid bytes that no later token can change) and any suffix that is a
prefix of a stop string.
"""

from __future__ import annotations

from engine.api import FinishReason, GenerationChunk, Tokenizer
from engine.detokenize import output_text
from engine.sequence import Sequence

MAX_PENDING_REPLACEMENTS = 3


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters of ``text`` to withhold for now."""
    hold = 0
    limit = min(len(text), MAX_PENDING_REPLACEMENTS)
    while hold < limit and text[len(text) - 1 - hold] == "\ufffd":
        hold += 1
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return hold


class OutputProcessor:
    """Turns a sequence's newest token into a finish decision and a chunk."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def process(self, seq: Sequence, prompt_tokens: int) -> GenerationChunk | None:
        """Check the newest token; return the chunk to emit (None = nothing new yet)."""
        p = seq.sampling
        last = seq.token_ids[-1]
        text_ids = seq.output_token_ids
        if last in p.stop_token_ids or (not p.ignore_eos and last in self.tokenizer.eos_token_ids):
            seq.finish_reason = FinishReason.STOP
            text_ids = text_ids[:-1]
        text = output_text(self.tokenizer, seq.detok.window, text_ids)
        if p.stop:
            text = self._cut_stop(seq, text)
        if seq.finish_reason is None and (
            seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len
        ):
            seq.finish_reason = FinishReason.LENGTH
        end = len(text) if seq.finish_reason else len(text) - _held_back(text, p.stop)
        return self.chunk(seq, text[:end], prompt_tokens)

    def _cut_stop(self, seq: Sequence, text: str) -> str:
        start = max(0, len(seq.detok.sent_text) - max(len(s) for s in seq.sampling.stop))
        hits = [i for i in (text.find(s, start) for s in seq.sampling.stop) if i >= 0]
        if not hits:
            return text
        if seq.finish_reason is None:
            seq.finish_reason = FinishReason.STOP
        return text[: min(hits)]

    def chunk(self, seq: Sequence, text: str, prompt_tokens: int) -> GenerationChunk | None:
        """The delta since the last chunk of this choice (None if empty and unfinished)."""
        d = seq.detok
        new_ids = tuple(seq.token_ids[seq.num_prompt_tokens + d.sent_num_tokens :])
        new_text = text[len(d.sent_text) :] if len(text) > len(d.sent_text) else ""
        if not new_ids and not new_text and seq.finish_reason is None:
            return None
        new_logprobs = tuple(seq.logprobs[d.logprobs_sent :])
        d.sent_num_tokens = seq.num_output_tokens
        d.logprobs_sent = len(seq.logprobs)
        d.sent_text = d.sent_text + new_text
        return GenerationChunk(
            request_id=seq.request_id,
            index=seq.index,
            token_ids=new_ids,
            text=new_text,
            finish_reason=seq.finish_reason,
            prompt_tokens=prompt_tokens,
            cached_tokens=seq.num_cached_tokens or 0,
            completion_tokens=seq.num_output_tokens,
            logprobs=new_logprobs,
            tier_cached_tokens=seq.tier_cached_tokens,
        )
