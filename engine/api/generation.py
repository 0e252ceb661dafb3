"""Run a :class:`PreparedRequest` on an engine: one engine request per prompt, their
chunks merged into OpenAI choices, then one usage total.

Choice numbering: prompt ``p`` with ``n`` choices owns choice indexes
``p*n .. p*n+n-1`` (as OpenAI numbers batched completions). Usage: the prompt is
counted once per prompt, ``cached_tokens`` (and the part of it tier 2 loaded,
``tier_cached_tokens``) as the engine reported it for choice 0 of that prompt,
completion tokens summed over all choices.

Cancellation: closing the returned iterator (client gone) closes every engine
stream and calls ``engine.abort`` for each unfinished request, shielded from the
surrounding cancellation so the blocks are always freed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field, replace

import anyio

from engine.api import AsyncEngineClient, GenerationChunk, GenerationRequest, Tokenizer
from engine.api.convert import PreparedRequest
from kvtoll.openai.responses import ChoiceResult, LogprobEntry, TierCachedTokens


@dataclass(frozen=True)
class ChoiceDelta:
    """New output of one choice. ``logprobs`` is None when they were not requested."""

    index: int
    text: str
    finish_reason: str | None
    logprobs: tuple[LogprobEntry, ...] | None = None
    # Set on the first delta of each prompt: prompt and prefix-cached tokens of every
    # prompt started so far (what a client leaving early is billed for).
    prompt_tokens: int | None = None
    cached_tokens: int | None = None


@dataclass(frozen=True)
class UsageTotals:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    tier_cached_tokens: TierCachedTokens | None = None  # None: the engine has no tier


@dataclass
class _UsageTracker:
    prompt_tokens: dict[int, int] = field(default_factory=dict)
    cached_tokens: dict[int, tuple[int, int]] = field(default_factory=dict)  # -> (choice, n)
    tier: dict[int, TierCachedTokens | None] = field(default_factory=dict)  # as cached_tokens
    completion_tokens: dict[tuple[int, int], int] = field(default_factory=dict)

    def add(self, prompt_index: int, chunk: GenerationChunk) -> None:
        self.prompt_tokens[prompt_index] = chunk.prompt_tokens
        seen = self.cached_tokens.get(prompt_index)
        if seen is None or chunk.index <= seen[0]:
            self.cached_tokens[prompt_index] = (chunk.index, chunk.cached_tokens)
            self.tier[prompt_index] = chunk.tier_cached_tokens
        self.completion_tokens[(prompt_index, chunk.index)] = chunk.completion_tokens

    def totals(self) -> UsageTotals:
        tiers = [t for t in self.tier.values() if t is not None]
        return UsageTotals(
            prompt_tokens=sum(self.prompt_tokens.values()),
            completion_tokens=sum(self.completion_tokens.values()),
            cached_tokens=sum(cached for _, cached in self.cached_tokens.values()),
            tier_cached_tokens=sum(tiers, TierCachedTokens()) if tiers else None,
        )


class _TokenTexts:
    """Decoded text of single tokens, for logprobs."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        if token_id not in self._cache:
            self._cache[token_id] = self._tokenizer.decode([token_id])
        return self._cache[token_id]

    def entries(self, chunk: GenerationChunk) -> tuple[LogprobEntry, ...]:
        return tuple(
            LogprobEntry(
                self.text(lp.token_id), lp.logprob, tuple((self.text(t), v) for t, v in lp.top)
            )
            for lp in chunk.logprobs
        )


def engine_request_ids(request_id: str, num_prompts: int) -> list[str]:
    """Engine request id per prompt: the request id itself when there is one prompt."""
    if num_prompts == 1:
        return [request_id]
    return [f"{request_id}-{i}" for i in range(num_prompts)]


async def _merge(
    streams: list[AsyncIterator[GenerationChunk]],
) -> AsyncGenerator[tuple[int, GenerationChunk], None]:
    """Interleave several engine streams as items arrive, tagged with their position."""
    if len(streams) == 1:
        async for chunk in streams[0]:
            yield 0, chunk
        return
    queue: asyncio.Queue[tuple[int, GenerationChunk | Exception | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[GenerationChunk]) -> None:
        try:
            async for chunk in stream:
                await queue.put((i, chunk))
            await queue.put((i, None))
        except Exception as exc:  # handed to the consumer, which re-raises it
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)


async def run_prepared(
    engine: AsyncEngineClient, prepared: PreparedRequest, request_id: str
) -> AsyncGenerator[ChoiceDelta | UsageTotals, None]:
    """Choice deltas in arrival order, then one :class:`UsageTotals`.

    Raises ``EngineRejected`` before yielding anything when the engine refuses.
    """
    ids = engine_request_ids(request_id, len(prepared.prompts))
    streams = [
        engine.generate(
            GenerationRequest(rid, prompt, prepared.sampling, prepared.salt, prepared.kv_share)
        )
        for rid, prompt in zip(ids, prepared.prompts, strict=True)
    ]
    want_logprobs = prepared.sampling.logprobs is not None
    texts = _TokenTexts(engine.tokenizer())
    usage = _UsageTracker()
    n = prepared.sampling.n
    finished = False
    merged = _merge(streams)
    try:
        async for p, chunk in merged:
            started = p not in usage.prompt_tokens
            usage.add(p, chunk)
            reason = chunk.finish_reason.value if chunk.finish_reason is not None else None
            logprobs = texts.entries(chunk) if want_logprobs else None
            delta = ChoiceDelta(p * n + chunk.index, chunk.text, reason, logprobs)
            if started:
                so_far = usage.totals()
                delta = replace(delta, prompt_tokens=so_far.prompt_tokens,
                                cached_tokens=so_far.cached_tokens)
            yield delta
        finished = True
        yield usage.totals()
    finally:
        if not finished:
            with anyio.CancelScope(shield=True):
                await merged.aclose()
                for rid, stream in zip(ids, streams, strict=True):
                    await _close(stream)
                    await engine.abort(rid)


async def _close(stream: AsyncIterator[GenerationChunk]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


@dataclass(frozen=True)
class Collected:
    """A whole (non-streamed) result."""

    choices: list[ChoiceResult]
    usage: UsageTotals


async def collect(stream: AsyncIterator[ChoiceDelta | UsageTotals], num_choices: int) -> Collected:
    """Drain :func:`run_prepared` into whole choices."""
    texts: list[list[str]] = [[] for _ in range(num_choices)]
    reasons: list[str | None] = [None] * num_choices
    logprobs: list[list[LogprobEntry] | None] = [None] * num_choices
    usage = UsageTotals(0, 0, 0)
    async for item in stream:
        if isinstance(item, UsageTotals):
            usage = item
            continue
        texts[item.index].append(item.text)
        reasons[item.index] = item.finish_reason or reasons[item.index]
        if item.logprobs is not None:
            logprobs[item.index] = (logprobs[item.index] or []) + list(item.logprobs)
    choices = [
        ChoiceResult(i, "".join(texts[i]), reasons[i], _tuple_or_none(logprobs[i]))
        for i in range(num_choices)
    ]
    return Collected(choices, usage)


def _tuple_or_none(entries: list[LogprobEntry] | None) -> tuple[LogprobEntry, ...] | None:
    return tuple(entries) if entries is not None else None
