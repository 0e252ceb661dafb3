"""The async face of the engine (:class:`engine.api.AsyncEngineClient`).

A background thread owns the :class:`LLMEngine` and runs ``step()`` while there is
work; callers talk to it only through a thread-safe op queue (add / abort) and get
chunks back on their own event loop via ``call_soon_threadsafe``::

    asyncio caller --ops queue--> step thread --call_soon_threadsafe--> asyncio.Queue

While a long step runs, the thread takes in new requests between its layers (and
delivers the chunks of steps interjected there, :mod:`engine.tenant_fair`) through
:class:`_StepHooks`; aborts that arrive meanwhile wait for the step's end.

Build one with :func:`engine.factory.build_engine` (``EngineConfig.tiny()`` for tests).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.api import (
    EngineLoad,
    EngineRejected,
    GenerationChunk,
    GenerationRequest,
    KVEvent,
    KVShare,
    Tokenizer,
)
from engine.kv.hashing import TenantSalt
from engine.kv.tenant_shares import check_share
from engine.llm_engine import LLMEngine
from engine.openmp_pool import release_thread_pool

log = logging.getLogger(__name__)

_Item = GenerationChunk | BaseException


@dataclass(frozen=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[_Item]


@dataclass(frozen=True)
class _Op:
    kind: str  # "add" | "abort" | "shares"
    request: GenerationRequest | None = None
    request_id: str = ""
    shares: tuple[tuple[TenantSalt, KVShare], ...] = ()


class AsyncEngine:
    """Runs an :class:`LLMEngine` on a background thread; streams chunks to asyncio."""

    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.5) -> None:
        self.engine = engine
        self._ops: queue.SimpleQueue[_Op] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._thread: threading.Thread | None = None
        self._thread_lock = threading.Lock()
        self._stopping = False
        self._idle_wait_s = idle_wait_s
        self._held_aborts: list[str] = []  # step thread only: aborts seen inside a step

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def block_size(self) -> int:
        return self.engine.block_size

    @property
    def dtype(self) -> str:
        return self.engine.dtype

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def validate(self, request: GenerationRequest) -> None:
        """Raise :class:`EngineRejected` now if ``request`` can never run."""
        self.engine.validate(request)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Stream chunks until every choice finished; see :class:`AsyncEngineClient`."""
        self.engine.validate(request)
        await self._prefetch(request)
        rid = request.request_id
        if rid in self._streams:
            raise EngineRejected(f"request_id: {rid!r} is already in flight")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[rid] = stream
        self._submit(_Op("add", request=request))
        remaining = request.sampling.n
        try:
            while remaining:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason is not None:
                    remaining -= 1
                yield item
        finally:
            self._streams.pop(rid, None)
            if remaining:
                self._submit(_Op("abort", request_id=rid))

    async def _prefetch(self, request: GenerationRequest) -> None:
        """Tier 2: copy the prompt's blocks that only the shared store holds into the
        host tier before the step loop sees the request (bounded by the store's
        timeout; a fault just means recompute)."""
        tier = self.engine.tier
        if tier is None or tier.shared is None:
            return
        cached = self.engine.kv.pool.cached
        try:
            await asyncio.to_thread(
                tier.prefetch, request.salt, request.prompt_token_ids, cached.__contains__
            )
        except Exception:  # a bug in the tier must not fail the request: recompute
            log.exception("prefetching KV blocks from the shared tier failed")

    def set_kv_shares(self, shares: list[tuple[TenantSalt, KVShare]]) -> list[str]:
        """Give each salt's tenant its share (the gateway's pushed policy table), applied
        on the step thread before its next step; the shares refused (one line each: a
        reservation larger than the pool, say), the others applied all the same."""
        num_blocks = self.engine.kv.pool.num_blocks
        accepted: list[tuple[TenantSalt, KVShare]] = []
        refused: list[str] = []
        for salt, share in shares:
            try:
                check_share(share, num_blocks)
            except ValueError as exc:
                refused.append(f"tenant {share.tenant!r}: {exc}")
                continue
            accepted.append((salt, share))
        if accepted:
            self._submit(_Op("shares", shares=tuple(accepted)))
        return refused

    async def abort(self, request_id: str) -> None:
        """Abort a request: its stream ends with ``abort`` chunks, its blocks are freed."""
        self._submit(_Op("abort", request_id=request_id))

    def load(self) -> EngineLoad:
        return self.engine.load()

    def kv_events(self, cursor: int, limit: int = 1000) -> list[KVEvent]:
        """Events with ``seq >= cursor`` in order (empty when none)."""
        return self.engine.kv_events(cursor, limit)

    def start(self) -> None:
        """Start the step thread (idempotent; ``generate`` starts it on demand)."""
        with self._thread_lock:
            if self._thread is None or not self._thread.is_alive():
                self._stopping = False
                # the step thread's ops get a pool of OpenMP threads of their own; the
                # one this thread's ops made (model load, probes) would make libgomp
                # throttle the spinning of both pools' workers (engine.openmp_pool)
                release_thread_pool()
                self._thread = threading.Thread(target=self._run, name="kvtoll-engine", daemon=True)
                self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the step thread (blocking); in-flight streams get an error."""
        self._stopping = True
        self._wake.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        self._fail_all(RuntimeError("engine shut down"))
        if self.engine.tier is not None:
            self.engine.tier.close()

    async def close(self) -> None:
        """Async :meth:`shutdown`."""
        await asyncio.to_thread(self.shutdown)

    def _submit(self, op: _Op) -> None:
        self._ops.put(op)
        self.start()
        self._wake.set()

    def _run(self) -> None:
        while not self._stopping:
            self._drain_ops()
            if not self.engine.has_unfinished():
                self._wake.wait(self._idle_wait_s)
                self._wake.clear()
                continue
            try:
                chunks = self.engine.step(_StepHooks(self))
            except Exception as exc:  # a bug: fail the requests, never hang them
                log.exception("engine step failed")
                self._abort_everything(exc)
                continue
            self._dispatch(chunks)

    def _drain_ops(self, adds_only: bool = False) -> None:
        """Apply queued ops in order; with ``adds_only`` (inside a step) aborts are kept
        for the next drain between steps."""
        if not adds_only:
            for request_id in self._held_aborts:
                self._dispatch(self.engine.abort_request(request_id))
            self._held_aborts.clear()
        while True:
            try:
                op = self._ops.get_nowait()
            except queue.Empty:
                return
            if op.kind == "shares":
                self._set_shares(op.shares)
            elif op.kind == "abort" and adds_only:
                self._held_aborts.append(op.request_id)
            elif op.kind == "abort":
                self._dispatch(self.engine.abort_request(op.request_id))
            elif op.request is not None:
                self._add(op.request)

    def _set_shares(self, shares: tuple[tuple[TenantSalt, KVShare], ...]) -> None:
        for salt, share in shares:
            try:
                self.engine.kv.pool.set_share(salt, share)
            except ValueError as exc:  # checked on submission; the pool has the last word
                log.warning("kv share of tenant %r refused: %s", share.tenant, exc)

    def _add(self, request: GenerationRequest) -> None:
        if request.request_id not in self._streams:
            return  # the caller went away before the engine saw it
        try:
            self.engine.add_request(request)
        except ValueError as exc:
            self._deliver(request.request_id, exc)

    def _dispatch(self, chunks: list[GenerationChunk]) -> None:
        """A step's chunks, in order, with one wake-up of each event loop they go to, not
        one per chunk: each ``call_soon_threadsafe`` writes the loop's self-pipe (64
        chunks: 126 us of the step thread one by one, 6 us batched, best case)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[str, _Stream, _Item]]] = {}
        for c in chunks:
            stream = self._streams.get(c.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((c.request_id, stream, c))
        for loop, items in by_loop.items():
            self._call_on(loop, items)

    def _deliver(self, request_id: str, item: _Item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            self._call_on(stream.loop, [(request_id, stream, item)])

    def _call_on(
        self, loop: asyncio.AbstractEventLoop, items: list[tuple[str, _Stream, _Item]]
    ) -> None:
        """Put ``items`` into their streams' queues on ``loop``, in order."""
        try:
            loop.call_soon_threadsafe(_put_all, [(s.queue, item) for _, s, item in items])
        except RuntimeError:  # the event loop is closed: its streams have no reader
            for rid, _, _ in items:
                self._streams.pop(rid, None)

    def _abort_everything(self, exc: BaseException) -> None:
        self.engine.abort_all()
        self._fail_all(RuntimeError(f"engine step failed: {exc}"))

    def _fail_all(self, exc: BaseException) -> None:
        for rid in list(self._streams):
            self._deliver(rid, exc)


def _put_all(queues: list[tuple[asyncio.Queue[_Item], _Item]]) -> None:
    for q, item in queues:
        q.put_nowait(item)


class _StepHooks:
    """The step thread's :class:`engine.llm_engine.StepHooks`: arrivals between two
    layers of a long step, and chunks of a step interjected there."""

    def __init__(self, owner: AsyncEngine) -> None:
        self._owner = owner

    def poll(self) -> bool:
        if self._owner._ops.empty():
            return False
        self._owner._drain_ops(adds_only=True)
        return True

    def deliver(self, chunks: list[GenerationChunk]) -> None:
        self._owner._dispatch(chunks)
