"""Model runner: owns the KV cache tensors, turns a batch into tensors, runs the model.

It sees only plain values (token ids, start positions, block ids) — never the
block pool or the scheduler. Slot of position ``p`` of a sequence::

    slot = block_ids[p // block_size] * block_size + p % block_size
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.decode_graphs import DecodeBatch, DecodeGraphs
from engine.host_memory import MMAP_THRESHOLD_BYTES, advise_huge_pages
from engine.kernels.cpu_fused import FusedKernels
from engine.kernels.kv_int8 import row_width
from engine.model.llama import KVCache, LlamaForCausalLM
from engine.model.rope import RotaryEmbedding


def _zeroed_cache(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """One layer's K or V cache, zeroed; on the CPU its memory advised into huge pages
    (engine.host_memory.advise_huge_pages: decode reads its blocks scattered over
    gigabytes) before the zeroing touches it, and any pages it reuses from the heap
    (a cache below glibc's mmap threshold) collapsed into huge ones. A cache at or above
    the threshold is a fresh mapping whose pages fault in huge as the zeroing touches
    them: collapsing it too made the kernel populate it first, and 1 GiB in 256 MiB
    caches (the tiny test model's) took 0.8-2.0 s to zero instead of ~0.5."""
    cache = torch.empty(shape, dtype=dtype, device=device)
    if cache.device.type == "cpu":
        nbytes = cache.numel() * cache.element_size()
        advise_huge_pages(cache.data_ptr(), nbytes, collapse=nbytes < MMAP_THRESHOLD_BYTES)
    return cache.zero_()


@dataclass(frozen=True)
class RunnerSeq:
    """One sequence's share of a step."""

    token_ids: tuple[int, ...]  # the new tokens to compute
    start: int  # their first position (= tokens already cached)
    block_ids: tuple[int, ...]
    needs_logits: bool

    def slots(self, block_size: int) -> list[int]:
        """The KV-cache slots of the new tokens (see the module docstring)."""
        ids, bs = self.block_ids, block_size
        positions = range(self.start, self.start + len(self.token_ids))
        return [ids[p // bs] * bs + p % bs for p in positions]


class ModelRunner:
    """Executes one step of the model over flattened tokens of many sequences."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        dtype: torch.dtype,
        device: str,
        graph_sizes: Sequence[int] = (),
        fused: FusedKernels | None = None,
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        """``graph_sizes``: batch sizes whose decode steps run as captured CUDA graphs
        (:mod:`engine.decode_graphs`; captured here, before any request); empty: eager.
        ``fused``: the decoder's small ops in native CPU kernels (:mod:`engine.kernels.
        cpu_fused`; CPU only: they write K/V into the caches themselves).
        ``kv_cache_dtype``: None for the model's ``dtype``, or ``torch.int8`` (rows of
        head_dim + 4 bytes, :mod:`engine.kernels.kv_int8`; the CPU backend's native
        kernels read them, and its ``prepare`` refuses them where those do not run)."""
        if kv_cache_dtype not in (None, dtype, torch.int8):
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype}: the model's dtype or int8")
        cfg = model.config
        if fused is not None and device != "cpu":
            raise ValueError(f"fused CPU kernels on device {device}")
        self.fused = fused
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.device = device
        cache_dtype = kv_cache_dtype or dtype
        width = row_width(cfg.head_size) if cache_dtype == torch.int8 else cfg.head_size
        shape = (num_blocks, block_size, cfg.num_key_value_heads, width)
        self.kv_caches: list[KVCache] = [
            (_zeroed_cache(shape, cache_dtype, device), _zeroed_cache(shape, cache_dtype, device))
            for _ in range(cfg.num_hidden_layers)
        ]
        self.rope = RotaryEmbedding(cfg, max_model_len, dtype, device)
        backend.prepare(cfg.num_attention_heads, self.kv_caches[0][0])
        self.graphs: DecodeGraphs | None = None
        if graph_sizes:
            max_blocks = -(-max_model_len // block_size)
            self.graphs = DecodeGraphs(
                self._logits_of_all_rows, graph_sizes, max_blocks, max_model_len,
                cfg.vocab_size, device,
            )  # fmt: skip
            with torch.inference_mode(), self._on_device():
                self.graphs.capture()

    def _on_device(self) -> AbstractContextManager[object]:
        """The engine's GPU as the current device: Triton launches and graph replays go
        to the current device, and the step thread starts on GPU 0."""
        if self.device.startswith("cuda"):
            return torch.cuda.device(self.device)
        return nullcontext()

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, elem: int
    ) -> int:
        """KV bytes of one block across all layers (K and V)."""
        return 2 * num_layers * block_size * num_kv_heads * head_dim * elem

    def build(
        self, batch: list[RunnerSeq]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """input_ids, positions, attention metadata and the rows whose logits are needed."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        logit_rows: list[int] = []
        for s in batch:
            ids.extend(s.token_ids)
            positions.extend(range(s.start, s.start + len(s.token_ids)))
            slots.extend(s.slots(bs))
            qsl.append(len(ids))
            if s.needs_logits:
                logit_rows.append(len(ids) - 1)
        max_blocks = max(len(s.block_ids) for s in batch)
        tables = [list(s.block_ids) + [0] * (max_blocks - len(s.block_ids)) for s in batch]
        seq_lens = tuple(s.start + len(s.token_ids) for s in batch)
        query_lens = tuple(len(s.token_ids) for s in batch)
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        return (
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            meta,
            torch.tensor(logit_rows, dtype=torch.long, device=dev),
        )

    @torch.inference_mode()
    def execute(self, batch: list[RunnerSeq]) -> torch.Tensor:
        """Run one step; float32 logits [num sequences needing logits, vocab], left on
        the device (sampling runs there; only the picked token ids travel)."""
        if not batch:
            raise ValueError("empty batch")
        with self._on_device():
            return self._execute(batch)

    def stages(self, batch: list[RunnerSeq]) -> bool:
        """Whether :meth:`start` may run ``batch`` (not a step replayed as a CUDA graph,
        which is one launch)."""
        return self.graphs is None or self._graph_decode(self.graphs, batch) is None

    def start(self, batch: list[RunnerSeq]) -> StagedForward:
        """The same step as :meth:`execute`, to run a layer at a time
        (:class:`StagedForward`); always eager (never a decode graph)."""
        if not batch:
            raise ValueError("empty batch")
        return StagedForward(self, *self.build(batch))

    def warmup(self, num_tokens: int, num_seqs: int) -> None:
        """Run a full-size prefill step (``num_tokens`` tokens over at least
        ``num_seqs`` sequences, more where ``max_model_len`` is short) and a decode step
        of the same sequences: each kernel a step launches is compiled for these shapes
        (Triton compiles at first launch; variants that Triton specialises on other
        values, e.g. the split count of long contexts, still compile at their first
        use) and the step's peak activation memory is reached.

        Before any request only: it writes K/V into arbitrary blocks (block ids wrap
        around the pool), which is harmless while no block holds a sequence.
        """
        for batch in warmup_batches(
            num_tokens, num_seqs, self.max_model_len, self.block_size, self.num_blocks
        ):
            self.execute(batch)
        if self.device.startswith("cuda"):
            torch.cuda.synchronize(self.device)

    def _execute(self, batch: list[RunnerSeq]) -> torch.Tensor:
        if self.graphs is not None:
            decode = self._graph_decode(self.graphs, batch)
            if decode is not None:
                return self.graphs.run(decode)
        input_ids, positions, meta, rows = self.build(batch)
        hidden = self.model(input_ids, positions, self.rope, self.kv_caches, meta, self.backend,
                            self.fused)  # fmt: skip
        return self.model.compute_logits(hidden.index_select(0, rows))

    def _logits_of_all_rows(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The forward a decode graph captures: logits of every row."""
        hidden = self.model(input_ids, positions, self.rope, self.kv_caches, meta, self.backend)
        return self.model.compute_logits(hidden)

    def _graph_decode(self, graphs: DecodeGraphs, batch: list[RunnerSeq]) -> DecodeBatch | None:
        """``batch`` as a decode step for ``graphs``, or None if it must run eagerly (a
        sequence with more than one new token or without logits, too many sequences or
        blocks)."""
        if not graphs.fits(len(batch), max(len(s.block_ids) for s in batch)):
            return None
        if not all(len(s.token_ids) == 1 and s.needs_logits for s in batch):
            return None
        return DecodeBatch(
            token_ids=[s.token_ids[0] for s in batch],
            positions=[s.start for s in batch],
            slots=[s.slots(self.block_size)[0] for s in batch],
            block_tables=[s.block_ids for s in batch],
        )


def warmup_batches(
    num_tokens: int, num_seqs: int, max_model_len: int, block_size: int, num_blocks: int
) -> tuple[list[RunnerSeq], list[RunnerSeq]]:
    """The prefill batch and the decode batch of :meth:`ModelRunner.warmup`.

    ``num_tokens`` prompt tokens split as evenly as possible over ``num_seqs``
    sequences (fewer if there are fewer tokens; more if a share would not leave room
    for one decoded token under ``max_model_len``); block ids count up from 0 and wrap
    around a pool of ``num_blocks``.
    """
    if min(num_tokens, num_seqs, block_size, num_blocks) <= 0 or max_model_len < 2:
        raise ValueError("warm-up needs positive sizes and max_model_len >= 2")
    n = max(min(num_seqs, num_tokens), -(-num_tokens // (max_model_len - 1)))
    lengths = [num_tokens // n + (1 if i < num_tokens % n else 0) for i in range(n)]
    next_block = 0
    prefill: list[RunnerSeq] = []
    decode: list[RunnerSeq] = []
    for length in lengths:
        count = -(-(length + 1) // block_size)  # the prompt and one decoded token
        blocks = tuple((next_block + i) % num_blocks for i in range(count))
        next_block += count
        prefill.append(RunnerSeq((0,) * length, 0, blocks, needs_logits=True))
        decode.append(RunnerSeq((0,), length, blocks, needs_logits=True))
    return prefill, decode


class StagedForward:
    """One step's forward, run a few layers per :meth:`advance`, so the engine can run
    other (short) steps between two layers of a long one (:mod:`engine.tenant_fair`).

    Between calls it holds the step's :class:`~engine.model.llama.LayerState` (eager or
    fused kernels alike); every layer already run has
    written this step's K/V into its blocks, which no other step writes (the
    scheduler allocated them to this step's sequences). The attention backends key
    their per-step plans on the metadata object, so a step in between only costs
    this one a re-plan. Logits equal :meth:`ModelRunner.execute`'s for the batch.
    """

    def __init__(
        self,
        runner: ModelRunner,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        rows: torch.Tensor,
    ) -> None:
        self._runner = runner
        self._meta = meta
        self._rows = rows
        self.num_layers = runner.model.num_layers
        self.next_layer = 0
        with torch.inference_mode(), runner._on_device():
            self._state = runner.model.begin(input_ids, positions, runner.rope, meta,
                                             runner.fused)  # fmt: skip

    @property
    def done(self) -> bool:
        return self.next_layer >= self.num_layers

    def advance(self, num_layers: int = 1) -> bool:
        """Run the next ``num_layers`` layers; whether layers remain after them."""
        if num_layers <= 0:
            raise ValueError(f"num_layers must be positive, got {num_layers}")
        stop = min(self.num_layers, self.next_layer + num_layers)
        r = self._runner
        with torch.inference_mode(), r._on_device():
            r.model.run_layers(self._state, r.kv_caches, self._meta, r.backend,
                               self.next_layer, stop)  # fmt: skip
        self.next_layer = stop
        return not self.done

    def logits(self) -> torch.Tensor:
        """The step's logits (as :meth:`ModelRunner.execute`); every layer must have run."""
        if not self.done:
            raise RuntimeError(f"logits before layer {self.next_layer} of {self.num_layers} ran")
        r = self._runner
        with torch.inference_mode(), r._on_device():
            hidden = r.model.finish(self._state)
            return r.model.compute_logits(hidden.index_select(0, self._rows))
