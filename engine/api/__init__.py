"""What the engine offers its callers (proxy, worker server): small frozen dataclasses
and the :class:`AsyncEngineClient` protocol. Nothing here touches tensors.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from engine.kv.hashing import BlockHash, TenantSalt
from kvtoll.openai.responses import TierCachedTokens

# The random-initialised test model's name (``EngineConfig.tiny()``; byte tokenizer).
TINY_MODEL = "kvtoll-tiny"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # caller went away or aborted


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs per token; None = off


@dataclass(frozen=True)
class KVShare:
    """A tenant's share of a worker's prefix cache, sent by the gateway with its salt.

    ``reserved_blocks``: cached blocks never evicted for another tenant; ``max_blocks``:
    the most cached blocks the tenant may hold (None = no cap); ``tenant``: its name, a
    label for metrics only.
    """

    tenant: str
    reserved_blocks: int = 0
    max_blocks: int | None = None


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    salt: TenantSalt | None = None  # server-derived; never from the end user
    kv_share: KVShare | None = None  # the salt's tenant share (None = leave as it is)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class GenerationChunk:
    """Incremental output of one of the ``n`` choices of a request."""

    request_id: str
    index: int  # choice index, 0 <= index < n
    token_ids: tuple[int, ...]  # new tokens since the previous chunk of this choice
    text: str  # new text since the previous chunk (stop strings already cut)
    finish_reason: FinishReason | None
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    completion_tokens: int  # tokens generated so far for this choice
    logprobs: tuple[TokenLogprob, ...] = ()
    # Of ``cached_tokens``, those tier 2 loaded back (host tier / shared store); None
    # when the engine has no tier.
    tier_cached_tokens: TierCachedTokens | None = None


@dataclass(frozen=True)
class TenantCacheLoad:
    """One tenant's part of a worker's prefix cache (counters since the worker started)."""

    tenant: str  # the name the gateway sent in its share ("" if none came yet)
    reserved_blocks: int
    max_blocks: int | None
    cached_blocks: int  # blocks holding this tenant's hashes now (free or in use)
    query_blocks: int  # prompt blocks looked up at admission
    hit_blocks: int  # of those, found cached
    evicted_blocks: int  # cached blocks of this tenant dropped


@dataclass(frozen=True)
class EngineLoad:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    block_size: int
    # Shared KV tier (engine.kv.tier): measured cost of loading a block over the cost of
    # recomputing it (a prior until measured); None when the worker has no shared tier.
    tier_load_fraction: float | None = None
    tenants: tuple[TenantCacheLoad, ...] = ()


class KVEventKind(enum.StrEnum):
    STORED = "stored"
    REMOVED = "removed"


@dataclass(frozen=True)
class KVEvent:
    seq: int  # position in the worker's ordered event log
    kind: KVEventKind
    block_hashes: tuple[BlockHash, ...] = field(default_factory=tuple)
    tenant: str = ""  # whose blocks (the share's name the gateway sent; "" if unknown)


class EngineRejected(ValueError):
    """The request can never run (too long for the context or the cache, n over cap...)."""


@runtime_checkable
class AcceptsKVShares(Protocol):
    """An engine that takes the gateway's pushed tenant policy table (kvtoll workers)."""

    def set_kv_shares(self, shares: list[tuple[TenantSalt, KVShare]]) -> list[str]:
        """Apply each salt's share; one line per share refused."""
        ...


class AsyncEngineClient(Protocol):
    """The async face of an engine: submit, stream, abort."""

    @property
    def model_name(self) -> str: ...

    @property
    def block_size(self) -> int: ...

    @property
    def dtype(self) -> str:
        """The floating-point type the model runs in (``float32``, ``bfloat16``)."""
        ...

    @property
    def max_model_len(self) -> int: ...

    def tokenizer(self) -> Tokenizer: ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Stream chunks until every choice finished; raises :class:`EngineRejected`
        before yielding anything if the request can never run. Closing the iterator
        early (client gone) aborts the request and frees its blocks."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def load(self) -> EngineLoad: ...

    def kv_events(self, cursor: int, limit: int = 1000) -> list[KVEvent]:
        """Events with ``seq >= cursor`` in order (empty when none)."""
        ...


class Tokenizer(Protocol):
    """Tokenizer and chat template from the model files."""

    eos_token_ids: tuple[int, ...]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, object]]) -> list[int]:
        """Token ids of the rendered chat prompt, with the generation prompt added."""
        ...
