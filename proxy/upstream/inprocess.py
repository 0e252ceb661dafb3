"""The embedded engine as an :class:`~proxy.upstream.base.Upstream` (``kvtoll serve``
without ``--worker``): no HTTP, the same conversion and generation code as the worker
server (:mod:`engine.serving`), the salt handed straight to the engine.

Errors: a request the engine can never run (too long, ``n`` over the cap, a feature
it lacks) is :class:`UpstreamRejected`; an engine failure is :class:`UpstreamError`,
retryable only while nothing was produced. Closing the stream aborts the request.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from dataclasses import replace
from typing import Any

from engine.api import AcceptsKVShares, AsyncEngineClient, EngineRejected, KVShare, Tokenizer
from engine.api.convert import PreparedRequest, prepare, rejection_param
from engine.api.generation import ChoiceDelta, UsageTotals, run_prepared
from engine.kv.hashing import TenantSalt
from kvtoll.openai.errors import OpenAIError
from kvtoll.openai.protocol import parse_request
from kvtoll.openai.responses import chat_logprobs, completion_logprobs
from proxy.upstream.base import (
    UpstreamDelta,
    UpstreamError,
    UpstreamRejected,
    UpstreamRequest,
    UpstreamUsage,
)

log = logging.getLogger(__name__)


class InProcessUpstream:
    """Wraps an :class:`AsyncEngineClient` living in this process."""

    def __init__(self, engine: AsyncEngineClient, name: str = "inprocess") -> None:
        self._engine = engine
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    @property
    def engine(self) -> AsyncEngineClient:
        return self._engine

    def tokenizer(self) -> Tokenizer:
        """The engine's tokenizer (the proxy counts and hashes prompts with it)."""
        return self._engine.tokenizer()

    async def push_kv_shares(self, shares: list[dict[str, Any]]) -> bool | None:
        """The gateway's tenant KV shares (:mod:`proxy.kv_policy_push`), straight to the
        engine; None if it takes none."""
        if not isinstance(self._engine, AcceptsKVShares):
            return None
        refused = self._engine.set_kv_shares([
            (TenantSalt(bytes.fromhex(e["cache_salt"])),
             KVShare(e["tenant"], e["reserved_blocks"], e["max_blocks"]))
            for e in shares
        ])  # fmt: skip
        for line in refused:
            log.warning("kv share refused: %s", line)
        return True

    def prepare(self, request: UpstreamRequest) -> PreparedRequest:
        """The engine input for ``request``; :class:`UpstreamRejected` if invalid."""
        try:
            parsed = request.parsed
            if parsed is None:
                parsed = parse_request(request.kind, request.body)
            prepared = prepare(
                parsed,
                self._engine.tokenizer(),
                self._engine.max_model_len,
                request.salt,
                request.prompt_token_ids,
            )
            return replace(prepared, kv_share=request.kv_share)
        except OpenAIError as exc:
            raise UpstreamRejected(exc.message, status=exc.status, param=exc.param) from None

    async def stream(
        self, request: UpstreamRequest
    ) -> AsyncGenerator[UpstreamDelta | UpstreamUsage, None]:
        """Deltas then one usage item (see :class:`~proxy.upstream.base.Upstream`)."""
        prepared = self.prepare(request)
        items = run_prepared(self._engine, prepared, request.request_id)
        offsets: dict[int, int] = {}
        produced = False
        counts: UpstreamDelta | None = None  # prompt counts of a delta not passed on
        try:
            async for item in items:
                if isinstance(item, UsageTotals):
                    yield UpstreamUsage(
                        item.prompt_tokens, item.completion_tokens, item.cached_tokens,
                        tier_cached_tokens=item.tier_cached_tokens,
                    )
                    continue
                delta = _delta(request.kind, item, offsets)
                if delta.cached_tokens is not None:
                    counts = delta
                if delta.text or delta.finish_reason or delta.logprobs:
                    if counts is not None:
                        delta = replace(delta, prompt_tokens=counts.prompt_tokens,
                                        cached_tokens=counts.cached_tokens)
                        counts = None
                    produced = True
                    yield delta
        except EngineRejected as exc:
            raise UpstreamRejected(str(exc), param=rejection_param(exc)) from None
        except (RuntimeError, OSError, ValueError) as exc:
            raise UpstreamError(f"engine failed: {exc}", retryable=not produced) from exc
        finally:
            await items.aclose()

    async def health(self) -> bool:
        """An in-process engine is up while this process is."""
        return True

    async def aclose(self) -> None:
        """Nothing to close: whoever built the engine shuts it down."""


def _delta(kind: str, item: ChoiceDelta, offsets: dict[int, int]) -> UpstreamDelta:
    logprobs = None
    if item.logprobs is not None:
        if kind == "chat":
            logprobs = chat_logprobs(item.logprobs)
        else:
            start = offsets.get(item.index, 0)
            logprobs = completion_logprobs(item.logprobs, start)
    offsets[item.index] = offsets.get(item.index, 0) + len(item.text)
    return UpstreamDelta(item.index, item.text, item.finish_reason, logprobs,
                         prompt_tokens=item.prompt_tokens, cached_tokens=item.cached_tokens)
