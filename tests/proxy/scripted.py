"""A deterministic upstream for proxy tests (stands in for the engine, not for the proxy).

It answers ``"word0 word1 ..."`` one word per delta, reports usage with the prompt
token count the proxy sent (or 7 when none) and can fail on demand.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from proxy.upstream.base import (
    UpstreamDelta,
    UpstreamError,
    UpstreamRequest,
    UpstreamUsage,
)


@dataclass
class ScriptedUpstream:
    upstream_name: str = "scripted-0"
    num_words: int = 5
    delay_s: float = 0.0
    fail_before_first: bool = False
    fail_after_words: int | None = None
    healthy: bool = True
    seen: list[UpstreamRequest] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    closed: bool = False

    @property
    def name(self) -> str:
        return self.upstream_name

    def stream(self, request: UpstreamRequest) -> AsyncIterator[UpstreamDelta | UpstreamUsage]:
        return self._stream(request)

    async def _stream(
        self, request: UpstreamRequest
    ) -> AsyncIterator[UpstreamDelta | UpstreamUsage]:
        self.seen.append(request)
        if self.fail_before_first:
            raise UpstreamError(f"{self.name} is down", retryable=True)
        max_tokens = int(request.body.get("max_tokens", self.num_words))
        count = min(self.num_words, max_tokens)
        n = int(request.body.get("n", 1))
        prompt = len(request.prompt_token_ids) if request.prompt_token_ids else 7
        finished = False
        try:
            for i in range(count):
                if self.fail_after_words is not None and i == self.fail_after_words:
                    raise UpstreamError("upstream crashed mid-way", retryable=False)
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                last = i == count - 1
                reason = ("stop" if count < max_tokens else "length") if last else None
                for index in range(n):
                    yield UpstreamDelta(index=index, text=f"word{i} ", finish_reason=reason)
            finished = True
            yield UpstreamUsage(prompt_tokens=prompt, completion_tokens=count * n)
        finally:
            if not finished:
                self.aborted.append(request.request_id)

    async def health(self) -> bool:
        return self.healthy

    async def aclose(self) -> None:
        self.closed = True
