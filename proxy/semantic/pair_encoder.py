"""The pair encoder: MiniLM fine-tuned on duplicate questions, scoring a pair by cosine.

``bench/train_pair_encoder.py`` fine-tunes all-MiniLM-L6-v2 (siamese: each text encoded
alone, mean pooling, L2-normalised) so that the cosine of two questions ranks duplicates
above near-duplicates; ``bench/export_pair_encoder.py`` packs the weights into
``data/pair_encoder.npz`` (matrices int8 per row with float16 scales, as
:func:`proxy.semantic.cross_encoder.pack_state`) beside ``data/pair_encoder.json`` (the
BERT config, the stacked weights, the threshold and the similarity floor).

:mod:`proxy.semantic.pair_verifier` scores a (query, cached prompt) pair with this
model's cosine in place of the index's, guard features stacked on it. At run time linear
layers are int8 with per-row activation scales and each text runs padded to its own
length bucket, so a text's vector is the same alone or in any batch. Vectors of cached
prompts are memoised (``memo_size``, LRU): a lookup's candidates are usually the
tenant's popular prompts, so most lookups encode only the query.

Torch is imported only inside the functions: importing this module loads nothing.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from proxy.semantic.cross_encoder import unpack_state
from proxy.semantic.padding import length_groups, pad_rows

WEIGHTS_FILE = "pair_encoder.npz"
CONFIG_FILE = "pair_encoder.json"


@dataclass(frozen=True)
class PairEncoderConfig:
    """What ``pair_encoder.json`` holds besides the weights."""

    bert: dict[str, Any]
    max_len: int
    min_similarity: float  # candidates below this index cosine are not scored
    stack: dict[str, Any]  # logistic weights over the guard features of the tuned cosine
    meta: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PairEncoderConfig:
        return cls(
            bert=dict(data["bert"]),
            max_len=int(data["max_len"]),
            min_similarity=float(data["min_similarity"]),
            stack=dict(data["stack"]),
            meta=dict(data.get("meta", {})),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "bert": self.bert,
            "max_len": self.max_len,
            "min_similarity": self.min_similarity,
            "stack": self.stack,
            "meta": self.meta,
        }


def load_shipped(directory: Path | None = None) -> tuple[PairEncoderConfig, dict[str, np.ndarray]]:
    """The shipped config and packed arrays (``directory``: another export's folder)."""
    if directory is None:
        base = resources.files("proxy.semantic.data")
        config_text = base.joinpath(CONFIG_FILE).read_text()
        with base.joinpath(WEIGHTS_FILE).open("rb") as fh:
            arrays = dict(np.load(fh))
    else:
        config_text = (directory / CONFIG_FILE).read_text()
        with np.load(directory / WEIGHTS_FILE) as npz:
            arrays = dict(npz)
    return PairEncoderConfig.from_json(json.loads(config_text)), arrays


def is_shipped() -> bool:
    """Whether the package carries pair-encoder weights."""
    base = resources.files("proxy.semantic.data")
    return base.joinpath(CONFIG_FILE).is_file() and base.joinpath(WEIGHTS_FILE).is_file()


class PairEncoder:
    """Texts -> the fine-tuned model's L2-normalised vectors (prompts memoised)."""

    def __init__(
        self,
        config: PairEncoderConfig,
        arrays: dict[str, np.ndarray],
        *,
        quantize: bool = True,
        memo_size: int = 8192,
        tokenizer_path: Path | None = None,
    ) -> None:
        import torch
        from tokenizers import Tokenizer
        from transformers import BertConfig, BertModel

        from proxy.semantic.embedder import bundled_model_path

        if memo_size < 0:
            raise ValueError("memo_size must be >= 0")
        self._config = config
        self._torch = torch
        model = BertModel(BertConfig.from_dict(dict(config.bert)), add_pooling_layer=False)
        state = {k: torch.from_numpy(v) for k, v in unpack_state(arrays).items()}
        model.load_state_dict(state)
        model.eval()
        if quantize:
            from proxy.semantic.rowquant import quantize_linears

            quantize_linears(model)
        self._model = _trace(model)
        path = tokenizer_path or bundled_model_path() / "tokenizer.json"
        tokenizer = Tokenizer.from_file(str(path))
        tokenizer.no_padding()
        tokenizer.enable_truncation(config.max_len)
        self._tokenizer = tokenizer
        self._lock = threading.Lock()  # the tokenizer and the memo, across worker threads
        self._memo: OrderedDict[str, np.ndarray] = OrderedDict()
        self._memo_size = memo_size
        self._dim = int(config.bert["hidden_size"])

    @property
    def config(self) -> PairEncoderConfig:
        return self._config

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Normalised float32 rows; one forward pass per length bucket."""
        out = np.zeros((len(texts), self._dim), dtype=np.float32)
        if not texts:
            return out
        torch = self._torch
        with self._lock:
            ids = [e.ids for e in self._tokenizer.encode_batch(list(texts))]
        for length, idx in length_groups([len(r) for r in ids], cap=self._config.max_len):
            batch, mask = pad_rows([ids[i] for i in idx], length)
            mask_t = torch.tensor(mask)
            with torch.inference_mode():
                states = self._model(torch.tensor(batch), mask_t)
                weights = mask_t.unsqueeze(-1).to(states.dtype)
                pooled = (states * weights).sum(1) / weights.sum(1).clamp(min=1.0)
                pooled = torch.nn.functional.normalize(pooled, dim=-1)
            out[idx] = pooled.numpy()
        return out

    def cosines(self, query: str, prompts: Sequence[str]) -> np.ndarray:
        """Cosine of ``query`` with each prompt (prompts' vectors from the memo if there)."""
        with self._lock:
            known = {p: self._memo[p] for p in prompts if p in self._memo}
            for p in known:
                self._memo.move_to_end(p)
        todo = [p for p in dict.fromkeys(prompts) if p not in known]
        vectors = self.embed([query, *todo])
        fresh = dict(zip(todo, vectors[1:], strict=True))
        if self._memo_size and fresh:
            with self._lock:
                self._memo.update(fresh)
                while len(self._memo) > self._memo_size:
                    self._memo.popitem(last=False)
        if not prompts:
            return np.zeros(0, dtype=np.float64)
        found = {**known, **fresh}
        query = vectors[0].astype(np.float64)  # one dot per prompt: the same sum in any batch
        return np.asarray([float(np.dot(found[p].astype(np.float64), query)) for p in prompts])


def _trace(model: Any) -> Any:
    import warnings

    import torch

    class Encoder(torch.nn.Module):
        def __init__(self, bert: Any) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    ids = torch.tensor([[101, 2129, 2079, 1045, 102], [101, 7592, 102, 0, 0]])
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")  # TracerWarnings about Python-side shape checks
        return torch.jit.trace(Encoder(model).eval(), (ids, (ids != 0).long()), check_trace=False)
