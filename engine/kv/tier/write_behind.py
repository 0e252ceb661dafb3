"""Write-behind: blocks gathered on the step thread are encoded and stored on another.

The step thread only gathers (one batched copy of the blocks, made before the pool
hands them out again) and enqueues; this thread moves the copy to the host, encodes
each block (:mod:`engine.kv.tier.codec`) and writes it to the host tier and/or the
shared store. Beyond ``max_blocks`` queued blocks new jobs are dropped (counted),
so a slow store can never grow memory without bound or stall the step loop.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

import torch

from engine.kv.tier.codec import BlockKey, TierMode, encode
from engine.kv.tier.host_store import HostTier
from engine.kv.tier.shared_redis import RedisBlockStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WriteJob:
    keys: tuple[BlockKey, ...]
    data: torch.Tensor  # [n, layers, 2, block, heads, dim], any device
    to_host: bool
    to_shared: bool


class WriteBehind:
    """One daemon thread draining a bounded queue of :class:`WriteJob`."""

    def __init__(
        self, host: HostTier, shared: RedisBlockStore | None, mode: TierMode, max_blocks: int
    ) -> None:
        self._host = host
        self._shared = shared
        self._mode = mode
        self._max_blocks = max_blocks
        self._queue: queue.Queue[WriteJob | None] = queue.Queue()
        self._queued = 0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.num_dropped = 0
        self.bytes_shared = 0

    def submit(self, job: WriteJob) -> bool:
        """Queue ``job``; False (dropped) when the backlog is full."""
        with self._lock:
            if self._queued + len(job.keys) > self._max_blocks:
                self.num_dropped += len(job.keys)
                return False
            self._queued += len(job.keys)
            if self._thread is None:
                thread = threading.Thread(target=self._run, name="kvtoll-kv-tier", daemon=True)
                self._thread = thread
                thread.start()
        self._queue.put(job)
        return True

    @property
    def num_queued(self) -> int:
        """Blocks submitted and not yet written."""
        with self._lock:
            return self._queued

    def drain(self) -> None:
        """Block until every queued job is written (tests, benchmarks)."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the thread (a later submit starts one)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(10.0)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                self._write(job)
            except Exception:  # a bug: lose this job, keep the thread
                log.exception("writing KV blocks to the tier failed")
            finally:
                if job is not None:
                    with self._lock:
                        self._queued -= len(job.keys)
                self._queue.task_done()

    def _write(self, job: WriteJob) -> None:
        data = job.data.to("cpu")
        shared: list[tuple[BlockKey, bytes]] = []
        for i, key in enumerate(job.keys):
            blob = encode(key, data[i], self._mode)
            if job.to_host:
                self._host.put(key.salt, key.block_hash, blob)
            if job.to_shared:
                shared.append((key, blob))
        if shared and self._shared is not None and self._shared.put_many(shared):
            self.bytes_shared += sum(len(b) for _, b in shared)
