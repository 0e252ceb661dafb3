"""engine.decode_graphs: the captured sizes, and how a step fills and pads the static
buffers (on CPU, where each replay runs the forward eagerly on those buffers; the
captured CUDA path is checked end to end in tests/engine/kernels on a GPU)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from engine.attention.base import AttentionMetadata
from engine.decode_graphs import SIZE_STEP, DecodeBatch, DecodeGraphs, graph_batch_sizes

VOCAB = 5


@pytest.mark.parametrize(
    ("max_num_seqs", "sizes"),
    [
        (1, (1,)),
        (6, (1, 2, 4, 6)),
        (16, (1, 2, 4, 8, 16)),
        (64, (1, 2, 4, 8, 16, 32, 48, 64)),
        (70, (1, 2, 4, 8, 16, 32, 48, 64, 70)),
    ],
)
def test_graph_batch_sizes(max_num_seqs: int, sizes: tuple[int, ...]) -> None:
    assert graph_batch_sizes(max_num_seqs) == sizes


def test_graph_batch_sizes_rejects_zero() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        graph_batch_sizes(0)


@given(st.integers(1, 1024))
def test_every_batch_has_a_graph_with_little_padding(max_num_seqs: int) -> None:
    sizes = graph_batch_sizes(max_num_seqs)
    assert list(sizes) == sorted(set(sizes)) and sizes[-1] == max_num_seqs
    for num in range(1, max_num_seqs + 1):
        size = next(s for s in sizes if s >= num)
        assert size - num < SIZE_STEP


class Recorder:
    """A stand-in forward (the model is not what these tests check): records what each
    call saw and returns logits that encode the row's token and length."""

    def __init__(self) -> None:
        self.calls: list[dict[str, list[int] | list[list[int]]]] = []

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        self.calls.append({
            "ids": input_ids.tolist(), "positions": positions.tolist(),
            "slots": meta.slot_mapping.tolist(), "seq_lens": meta.seq_lens.tolist(),
            "tables": meta.block_tables.tolist(), "qsl": meta.query_start_loc.tolist(),
        })  # fmt: skip
        assert meta.is_decode_only and meta.num_seqs == input_ids.shape[0]
        logits = torch.zeros(input_ids.shape[0], VOCAB)
        logits[:, 0] = input_ids.float()
        logits[:, 1] = meta.seq_lens.float()
        return logits


def _graphs(recorder: Recorder, sizes: tuple[int, ...] = (1, 2, 4)) -> DecodeGraphs:
    graphs = DecodeGraphs(recorder, sizes, 4, 64, VOCAB, "cpu")
    graphs.capture()
    return graphs


def test_capture_runs_each_size_on_padding_rows() -> None:
    recorder = Recorder()
    _graphs(recorder)
    assert [len(c["ids"]) for c in recorder.calls] == [4, 2, 1]  # largest first
    for call in recorder.calls:
        assert set(call["slots"]) == {-1}  # writes no KV
        assert set(call["seq_lens"]) == {1}


def test_a_batch_runs_on_the_next_size_with_padding_rows() -> None:
    recorder = Recorder()
    graphs = _graphs(recorder)
    recorder.calls.clear()
    batch = DecodeBatch(
        token_ids=[7, 8, 9], positions=[20, 3, 40], slots=[52, 67, 88],
        block_tables=[[3, 1], [4], [2, 0, 5]],
    )  # fmt: skip
    logits = graphs.run(batch)
    (call,) = recorder.calls
    assert call["ids"] == [7, 8, 9, 0]
    assert call["positions"] == [20, 3, 40, 0]
    assert call["slots"] == [52, 67, 88, -1]
    assert call["seq_lens"] == [21, 4, 41, 1]
    assert call["qsl"] == [0, 1, 2, 3, 4]
    assert call["tables"] == [[3, 1, 0, 0], [4, 0, 0, 0], [2, 0, 5, 0], [0, 0, 0, 0]]
    assert logits.shape == (3, VOCAB)
    assert logits[:, 0].tolist() == [7, 8, 9] and logits[:, 1].tolist() == [21, 4, 41]
    assert graphs.num_replays == 1


def test_rows_of_a_bigger_earlier_batch_become_padding() -> None:
    """A stale row left by a bigger step must not write KV in a later, smaller one."""
    recorder = Recorder()
    graphs = _graphs(recorder)
    graphs.run(DecodeBatch([1, 2, 3, 4], [5, 6, 7, 8], [10, 11, 12, 13], [[0]] * 4))
    recorder.calls.clear()
    graphs.run(DecodeBatch([9, 9, 9], [1, 1, 1], [30, 31, 32], [[1]] * 3))
    (call,) = recorder.calls
    assert call["slots"] == [30, 31, 32, -1]
    assert call["seq_lens"] == [2, 2, 2, 1]
    assert call["ids"][3] == 0


def test_fits_and_errors() -> None:
    graphs = DecodeGraphs(Recorder(), (1, 2), 2, 32, VOCAB, "cpu")
    assert graphs.fits(2, 2) and not graphs.fits(3, 1) and not graphs.fits(1, 3)
    assert not graphs.fits(0, 1)
    with pytest.raises(RuntimeError, match="before capture"):
        graphs.run(DecodeBatch([1], [0], [0], [[0]]))
    graphs.capture()
    with pytest.raises(ValueError, match="does not fit"):
        graphs.run(DecodeBatch([1], [0], [0], [[0, 1, 2]]))
    with pytest.raises(ValueError, match="increasing"):
        DecodeGraphs(Recorder(), (2, 1), 2, 32, VOCAB, "cpu")
    with pytest.raises(ValueError, match="one position"):
        DecodeBatch([1, 2], [0], [0], [[0]])
