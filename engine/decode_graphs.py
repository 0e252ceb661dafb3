"""CUDA graphs for decode steps: the whole model forward of a batch of one-token
sequences, captured once per batch size and replayed each step.

An eager decode step launches a few hundred small kernels (about ten per layer plus
the attention kernels), and for a small model each launch costs more host time than
the GPU spends on it. A replay submits them all at once. A captured graph fixes every
tensor address and every kernel's grid, so a step works on static buffers:

* input ids, positions, slot mapping, sequence lengths and block tables are copied
  into buffers sized for the largest captured batch; a batch of ``b`` sequences runs
  the graph of the smallest captured size ``>= b``, padded with rows that write no KV
  (slot -1, which the KV-write kernel skips) and attend to one token;
* attention sees an upper bound for the lengths (the model's context length): the
  decode kernel splits each sequence's context by its own length on the device
  (:mod:`engine.kernels.decode_attention`), so nothing on the host changes between
  replays;
* every graph writes its logits into one shared [largest size, vocab] buffer; the step
  returns a copy of its rows.

Only the Triton backend is captured: the torch and CPU backends plan on the host from
the lengths. Off CUDA nothing is captured and each "replay" runs the same forward
eagerly on the same buffers, which is how tests check the padding on a CPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.attention.base import AttentionMetadata

log = logging.getLogger(__name__)

# Batch sizes captured: 1, 2, 4, 8, then every 16 up to max_num_seqs (nano-vllm's
# ladder; vLLM steps by 8): a batch pads at most 15 rows.
SMALL_SIZES = (1, 2, 4, 8)
SIZE_STEP = 16

StepForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def graph_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The captured batch sizes for at most ``max_num_seqs`` sequences per step."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
    ladder = {*SMALL_SIZES, *range(SIZE_STEP, max_num_seqs + 1, SIZE_STEP), max_num_seqs}
    return tuple(sorted(s for s in ladder if s <= max_num_seqs))


@dataclass(frozen=True)
class DecodeBatch:
    """One decode step's inputs on the host: one new token per sequence."""

    token_ids: Sequence[int]
    positions: Sequence[int]
    slots: Sequence[int]
    block_tables: Sequence[Sequence[int]]

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if not n or not len(self.positions) == len(self.slots) == len(self.block_tables) == n:
            raise ValueError("a decode batch needs one position, slot and table per token")


class DecodeGraphs:
    """Static decode buffers plus one captured forward per batch size."""

    def __init__(
        self,
        forward: StepForward,
        sizes: Sequence[int],
        max_blocks_per_seq: int,
        max_model_len: int,
        vocab_size: int,
        device: str,
    ) -> None:
        """``forward(input_ids, positions, meta)`` returns float32 logits [rows, vocab]
        for every row; it must run only device work (no host sync, no host-side use of
        the lengths). Call :meth:`capture` before the first :meth:`run`."""
        if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"graph batch sizes must be increasing and positive: {sizes}")
        self.sizes = tuple(sizes)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.max_model_len = max_model_len
        self._forward = forward
        self._on_cuda = torch.device(device).type == "cuda"
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((n, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.logits = torch.zeros((n, vocab_size), dtype=torch.float32, device=device)
        # Captured sizes -> their graph; None off CUDA, where a replay runs the forward.
        self._graphs: dict[int, torch.cuda.CUDAGraph | None] = {}
        self.num_replays = 0  # decode steps run on the graphs (metrics, tests)

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def fits(self, num_seqs: int, max_blocks: int) -> bool:
        """Whether a decode step of ``num_seqs`` sequences with block tables of at most
        ``max_blocks`` entries can run on the captured graphs."""
        return 0 < num_seqs <= self.max_size and max_blocks <= self.max_blocks_per_seq

    def metadata(self, size: int) -> AttentionMetadata:
        """Attention metadata over the first ``size`` rows of the static buffers; the
        host-side lengths are the upper bound ``max_model_len``."""
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            slot_mapping=self.slot_mapping[:size],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_lens_cpu=(1,) * size,
            seq_lens_cpu=(self.max_model_len,) * size,
        )

    def _call(self, size: int) -> None:
        """The forward over the first ``size`` rows, its logits stored in ``self.logits``."""
        meta = self.metadata(size)
        logits = self._forward(self.input_ids[:size], self.positions[:size], meta)
        self.logits[:size].copy_(logits)

    def capture(self) -> None:
        """Capture every size, largest first so the smaller graphs share its memory
        pool. The buffers hold padding rows (slot -1), so warm-up and capture write no
        KV. Off CUDA this only runs each size once, to check it runs."""
        start = time.perf_counter()
        pool = None
        for size in reversed(self.sizes):
            if not self._on_cuda:
                self._call(size)
                self._graphs[size] = None
                continue
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: compiles kernels, sets up cuBLAS
                self._call(size)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._call(size)
            pool = graph.pool()
            self._graphs[size] = graph
        if self._on_cuda:
            torch.cuda.synchronize()
        log.info(
            "decode graphs: %d batch sizes up to %d captured in %.1f s",
            len(self.sizes), self.max_size, time.perf_counter() - start,
        )  # fmt: skip

    def run(self, batch: DecodeBatch) -> torch.Tensor:
        """Logits [len(batch.token_ids), vocab] (float32, a copy) of one decode step."""
        num = len(batch.token_ids)
        width = max(len(t) for t in batch.block_tables)
        if not self.fits(num, width):
            raise ValueError(f"a decode step of {num} sequences x {width} blocks does not fit "
                             f"the graphs ({self.max_size} x {self.max_blocks_per_seq})")
        size = next(s for s in self.sizes if s >= num)
        if size not in self._graphs:
            raise RuntimeError("DecodeGraphs.run before capture")
        self._load(batch, size, width)
        self.num_replays += 1
        graph = self._graphs[size]
        if graph is not None:
            graph.replay()
        else:
            self._call(size)
        return self.logits[:num].clone()

    def _load(self, batch: DecodeBatch, size: int, width: int) -> None:
        """Copy the batch into the static buffers; rows ``num..size`` become padding."""
        pad = size - len(batch.token_ids)

        def host(values: Sequence[int], fill: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor([*values, *([fill] * pad)], dtype=dtype)

        self.input_ids[:size].copy_(host(batch.token_ids, 0, torch.long))
        self.positions[:size].copy_(host(batch.positions, 0, torch.long))
        self.slot_mapping[:size].copy_(host(batch.slots, -1, torch.int64))
        self.seq_lens[:size].copy_(host([p + 1 for p in batch.positions], 1, torch.int32))
        tables = [[*t, *([0] * (width - len(t)))] for t in batch.block_tables]
        tables.extend([[0] * width] * pad)
        self.block_tables[:size, :width].copy_(torch.tensor(tables, dtype=torch.int32))
