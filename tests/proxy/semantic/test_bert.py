"""proxy.semantic.bert's encoder against transformers' BertModel, which trained the
shipped weights: the same hidden states bit for bit (so every vector, score and hit
decision is unchanged), and a semantic cache built without importing transformers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from proxy.semantic.bert import bert_encoder
from proxy.semantic.cross_encoder import unpack_state
from proxy.semantic.pair_encoder import is_shipped, load_shipped
from proxy.semantic.rowquant import quantize_linears

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.skipif(not is_shipped(), reason="no pair-encoder weights in the package")


def _pair() -> tuple[Any, Any]:
    """The shipped pair encoder's weights in transformers' model and in ours."""
    from transformers import BertConfig, BertModel

    config, arrays = load_shipped()
    state = {k: torch.from_numpy(v) for k, v in unpack_state(arrays).items()}
    theirs = BertModel(BertConfig.from_dict(dict(config.bert)), add_pooling_layer=False)
    theirs.load_state_dict(state)
    ours = bert_encoder(config.bert)
    ours.load_state_dict(state, strict=True)  # every name matches, none missing
    return theirs.eval(), ours


@pytest.mark.parametrize("quantized", [False, True])
def test_hidden_states_equal_transformers_bit_for_bit(quantized: bool) -> None:
    """Padded rows (only real tokens compared: pooling weighs padding by 0), token types
    given or not, float32 or the int8 linears the gateway runs."""
    theirs, ours = _pair()
    if quantized:
        quantize_linears(theirs)
        quantize_linears(ours)
    gen = torch.Generator().manual_seed(0)
    for batch, length, pad in [(1, 7, 0), (3, 12, 4), (5, 33, 9)]:
        ids = torch.randint(1000, 30000, (batch, length), generator=gen)
        mask = torch.ones(batch, length, dtype=torch.long)
        mask[1:, length - pad :] = 0
        ids[mask == 0] = 0
        types = (torch.arange(length) >= length // 2).long().expand(batch, -1)
        for token_types in (None, types):
            with torch.inference_mode():
                expected = theirs(input_ids=ids, attention_mask=mask,
                                  token_type_ids=token_types).last_hidden_state  # fmt: skip
                got = ours(ids, mask, token_types)
            real = mask.bool()
            assert torch.equal(got[real], expected[real]), (batch, length, token_types)


def test_other_architectures_are_refused() -> None:
    config, _ = load_shipped()
    for change, message in [({"hidden_act": "relu"}, "GELU"),
                            ({"position_embedding_type": "relative_key"}, "absolute"),
                            ({"num_attention_heads": 5}, "multiple")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            bert_encoder({**config.bert, **change})


def test_a_semantic_cache_loads_without_transformers() -> None:
    """Importing transformers' BERT took ~3-4 s of a core and ~220 MB at each start."""
    code = ("import sys; from proxy.semantic.factory import build_semantic_cache; "
            "build_semantic_cache(None); names = ('transformers', 'sentence_transformers'); "
            "print(sorted(m for m in names if m in sys.modules))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
