"""The upstream interface: an engine (in-process or over HTTP) or any OpenAI-compatible
server. The proxy sends a normalised :class:`UpstreamRequest` and reads back a stream
of :class:`UpstreamDelta` items ending with exactly one :class:`UpstreamUsage`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from engine.api import KVShare
from engine.kv.hashing import TenantSalt
from kvtoll.openai.protocol import OpenAIRequest
from kvtoll.openai.responses import TierCachedTokens


@dataclass(frozen=True)
class UpstreamRequest:
    request_id: str
    kind: Literal["chat", "completion"]
    model: str
    # The validated OpenAI request body (chat: messages...; completion: prompt...),
    # stripped of proxy-only fields and of anything the client sent about caching salts.
    body: dict[str, Any]
    salt: TenantSalt  # server-derived from tenant id + server secret
    prompt_token_ids: tuple[int, ...] | None = None  # when the proxy tokenized already
    # ``body`` as the gateway parsed it (once, at intake); None: the upstream validates
    # ``body`` itself (requests built outside the gateway).
    parsed: OpenAIRequest | None = None
    kv_share: KVShare | None = None  # the tenant's share of a kvtoll worker's prefix cache
    # The client asked for one whole response (``stream`` false): an upstream that
    # ``answers_whole`` (HTTP) asks its server for one too (see :func:`answers_whole`).
    whole: bool = False


@dataclass(frozen=True)
class UpstreamDelta:
    index: int  # choice index
    text: str = ""
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    # The prompt as the upstream counted it so far (every prompt whose first chunk has
    # arrived), and how much of it came from its prefix cache. Set on the first delta
    # when the upstream knows it (kvtoll engines and workers), so the gateway can say
    # ``x-kvtoll-cache: prefix`` before the usage item and bill cached tokens when the
    # client leaves early; None: unknown.
    prompt_tokens: int | None = None
    cached_tokens: int | None = None


@dataclass(frozen=True)
class UpstreamUsage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    # Of ``cached_tokens``, those a kvtoll worker's KV tier loaded (host / shared);
    # None: the upstream has no tier or did not say.
    tier_cached_tokens: TierCachedTokens | None = None


class UpstreamError(RuntimeError):
    """The upstream failed. ``retryable`` is true when nothing was produced yet."""

    def __init__(self, message: str, *, status: int = 502, retryable: bool = True) -> None:
        super().__init__(message)
        self.status = status
        self.retryable = retryable


class UpstreamRejected(ValueError):
    """The upstream refused the request as invalid (a 4xx): the caller's mistake."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


@runtime_checkable
class ReportsUsageProblems(Protocol):
    """An upstream that can tell why its usage reports fall short of what billing needs
    (:mod:`proxy.upstream.usage_report`)."""

    def usage_problem(self) -> str | None: ...


def answers_whole(upstream: object) -> bool:
    """Whether ``upstream`` answers a :attr:`~UpstreamRequest.whole` request in one piece
    (its first item comes only once the answer is complete, so the gateway's wait for it
    is the whole-response timeout, not the first-byte one): an ``answers_whole``
    attribute, false when absent (streaming upstreams: in-process engine, test fakes)."""
    return getattr(upstream, "answers_whole", False) is True


class Upstream(Protocol):
    """One place requests can go. ``name`` is what ``x-kvtoll-worker`` shows."""

    @property
    def name(self) -> str: ...

    def stream(self, request: UpstreamRequest) -> AsyncIterator[UpstreamDelta | UpstreamUsage]:
        """Deltas in order, then one usage item. Raises :class:`UpstreamRejected` or
        :class:`UpstreamError`; closing the iterator early aborts upstream work."""
        ...

    async def health(self) -> bool: ...

    async def aclose(self) -> None: ...
