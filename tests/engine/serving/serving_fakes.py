"""A small in-memory AsyncEngineClient for unit tests of the serving layer.

It stands in for the *engine* (another part), never for the serving code under
test: byte-level tokenizer, prefix caching with the real block hashing (so salts
isolate), KV events, a deterministic reply, and records of aborts.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engine.api import (
    EngineLoad,
    EngineRejected,
    FinishReason,
    GenerationChunk,
    GenerationRequest,
    KVEvent,
    KVEventKind,
    TokenLogprob,
)
from engine.kv.hashing import BlockHash, hash_prompt_blocks

REPLY = "hello world, this is the fake engine speaking. "


class ByteTokenizer:
    """One token per UTF-8 byte; id 0 is EOS."""

    eos_token_ids: tuple[int, ...] = (0,)
    vocab_size = 256

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        return bytes(token_ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, object]]) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"
        return self.encode(text)


@dataclass
class FakeEngine:
    model_name: str = "fake-model"
    block_size: int = 4
    max_model_len: int = 256
    dtype: str = "float32"
    max_n: int = 4
    num_total_blocks: int = 64
    token_delay_s: float = 0.0
    aborted: list[str] = field(default_factory=list)
    abort_calls: list[str] = field(default_factory=list)
    requests: list[GenerationRequest] = field(default_factory=list)
    _stored: set[BlockHash] = field(default_factory=set)
    _events: list[KVEvent] = field(default_factory=list)
    _running: set[str] = field(default_factory=set)

    def tokenizer(self) -> ByteTokenizer:
        return ByteTokenizer()

    def _admit(self, request: GenerationRequest) -> int:
        s = request.sampling
        if s.n > self.max_n:
            raise EngineRejected(f"n: must be between 1 and {self.max_n}, got {s.n}")
        if len(request.prompt_token_ids) + s.max_tokens > self.max_model_len:
            raise EngineRejected("max_tokens: does not fit the context")
        hashes = hash_prompt_blocks(request.prompt_token_ids, self.block_size, request.salt)
        hits = 0
        for h in hashes:
            if h not in self._stored:
                break
            hits += 1
        new = tuple(h for h in hashes[hits:])
        self._stored.update(new)
        if new:
            self._events.append(KVEvent(len(self._events), KVEventKind.STORED, new))
        return hits * self.block_size

    def evict_all(self) -> None:
        """Drop every cached block (emits one REMOVED event)."""
        if self._stored:
            gone = tuple(sorted(self._stored))
            self._stored.clear()
            self._events.append(KVEvent(len(self._events), KVEventKind.REMOVED, gone))

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        cached = self._admit(request)
        self.requests.append(request)
        self._running.add(request.request_id)
        s = request.sampling
        produced = {i: "" for i in range(s.n)}
        finished = False
        try:
            for step in range(s.max_tokens):
                for i in range(s.n):
                    if i not in produced:
                        continue
                    ch = REPLY[(step + i) % len(REPLY)]
                    produced[i] += ch
                    reason = FinishReason.LENGTH if step == s.max_tokens - 1 else None
                    text = ch
                    for stop in s.stop:
                        if produced[i].endswith(stop):
                            reason = FinishReason.STOP
                            text = ""
                    lps = (TokenLogprob(ord(ch), -0.5, ((ord(ch), -0.5),)),) if s.logprobs else ()
                    yield GenerationChunk(
                        request.request_id,
                        i,
                        (ord(ch),),
                        text,
                        reason,
                        len(request.prompt_token_ids),
                        cached,
                        step + 1,
                        lps,
                    )
                    if reason is not None:
                        del produced[i]
                if not produced:
                    break
                await asyncio.sleep(self.token_delay_s)
            finished = True
        finally:
            self._running.discard(request.request_id)
            if not finished:
                self.aborted.append(request.request_id)

    async def abort(self, request_id: str) -> None:
        self.abort_calls.append(request_id)

    def load(self) -> EngineLoad:
        free = self.num_total_blocks - len(self._stored)
        return EngineLoad(len(self._running), 0, free, self.num_total_blocks, self.block_size)

    def kv_events(self, cursor: int, limit: int = 1000) -> list[KVEvent]:
        return self._events[cursor : cursor + limit]
