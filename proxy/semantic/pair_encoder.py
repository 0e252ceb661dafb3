"""The pair encoder: MiniLM fine-tuned on duplicate questions, the cache's default embedder.

``bench/train_pair_encoder.py`` fine-tunes all-MiniLM-L6-v2 (siamese: each text encoded
alone, mean pooling, L2-normalised) so that the cosine of two questions ranks duplicates
above near-duplicates; ``bench/export_pair_encoder.py`` packs the weights into
``data/pair_encoder.npz`` (matrices int8 per row with float16 scales, as
:func:`proxy.semantic.cross_encoder.pack_state`) beside ``data/pair_encoder.json`` (the
BERT config, the stacked weights, the threshold and the similarity floor).

:class:`PairEncoder` is an :class:`proxy.semantic.embedder.Embedder`: its vectors go into
the FAISS index, so the index's cosine of a candidate *is* the tuned cosine and
:mod:`proxy.semantic.pair_verifier` stacks the guard features on it without running a
model again (one forward per lookup). Its ``name`` carries a digest of the weights, and
each entry records the name of the embedder that wrote its vector
(``CacheEntry.embedder``), so vectors of two models are never compared. At run time
linear layers are int8 with per-row activation scales and each text runs padded to its
own length bucket, so a text's vector is the same alone or in any batch.

Torch is imported only inside the functions: importing this module loads nothing.
"""

from __future__ import annotations

import hashlib
import json
import threading
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
    """Texts -> the fine-tuned model's L2-normalised float32 vectors (an ``Embedder``)."""

    def __init__(
        self,
        config: PairEncoderConfig,
        arrays: dict[str, np.ndarray],
        *,
        quantize: bool = True,
        tokenizer_path: Path | None = None,
    ) -> None:
        import torch
        from tokenizers import Tokenizer

        from proxy.semantic.bert import bert_encoder
        from proxy.semantic.embedder import bundled_model_path

        self._config = config
        self._torch = torch
        model = bert_encoder(config.bert)
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
        self._lock = threading.Lock()  # the tokenizer, across worker threads
        self._dim = int(config.bert["hidden_size"])
        mode = "int8-row" if quantize else "fp32"
        self._name = f"kvtoll-pair-encoder/{weights_digest(arrays)}/{mode}"

    @property
    def config(self) -> PairEncoderConfig:
        return self._config

    @property
    def dim(self) -> int:
        return self._dim

    @property
    def name(self) -> str:
        """Names the weights (a digest) and the arithmetic: vectors of one name compare."""
        return self._name

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


def weights_digest(arrays: dict[str, np.ndarray]) -> str:
    """First 12 hex digits of SHA-256 over the packed arrays (names, dtypes, shapes, bytes)."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        value = np.ascontiguousarray(arrays[name])
        digest.update(f"{name}:{value.dtype.str}:{value.shape}".encode())
        digest.update(value.tobytes())
    return digest.hexdigest()[:12]


def load_pair_encoder(directory: Path | None = None) -> PairEncoder:
    """The shipped pair encoder (or the export in ``directory``)."""
    config, arrays = load_shipped(directory)
    return PairEncoder(config, arrays)


def _trace(model: Any) -> Any:
    import warnings

    import torch

    class Encoder(torch.nn.Module):
        def __init__(self, bert: Any) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return self.bert(input_ids, attention_mask)

    ids = torch.tensor([[101, 2129, 2079, 1045, 102], [101, 7592, 102, 0, 0]])
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")  # TracerWarnings about Python-side shape checks
        return torch.jit.trace(Encoder(model).eval(), (ids, (ids != 0).long()), check_trace=False)
