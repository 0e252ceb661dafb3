"""The cross-encoder: MiniLM reading ``[CLS] a [SEP] b [SEP]``, a linear head on [CLS].

Training (``bench/train_cross_encoder.py``) builds :class:`PairClassifier` from the
offline MiniLM weights; ``bench/export_cross_encoder.py`` packs the trained state into
``data/cross_encoder.npz`` (2-D tensors int8 per row with a float16 scale, the rest
float32, see :func:`pack_state`) beside ``data/cross_encoder.json`` (the BERT config, the
Platt calibration and the threshold chosen on the calib split). :class:`CrossEncoder`
loads them on CPU and turns text pairs into calibrated probabilities: linear layers in
int8 with per-row activation scales (:mod:`proxy.semantic.rowquant`) and each pair padded
to its own length bucket (:mod:`proxy.semantic.padding`), so a pair's score does not
depend on the other pairs of its batch. The tokenizer is MiniLM's own (same vocabulary).

Torch is imported only inside this module's functions: importing it costs nothing,
building a model loads it. The run-time model is :mod:`proxy.semantic.bert`'s encoder;
only training loads ``transformers``.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import numpy as np

from proxy.semantic.padding import length_groups, pad_rows

WEIGHTS_FILE = "cross_encoder.npz"
CONFIG_FILE = "cross_encoder.json"
SCALE_SUFFIX = "::scale"
MAX_BATCH = 64  # pairs per forward pass
Precision = Literal["int8", "fp32", "bf16"]
Pool = Literal["cls", "mean"]  # the head reads [CLS]'s state, or the mean of all tokens


def _make_class() -> Any:
    import torch

    class _PairClassifier(torch.nn.Module):
        def __init__(self, encoder: Any, pool: Pool) -> None:
            super().__init__()
            if pool not in ("cls", "mean"):
                raise ValueError(f"pool must be 'cls' or 'mean', not {pool!r}")
            self.encoder = encoder
            self.mean_pool = pool == "mean"
            self.dropout = torch.nn.Dropout(0.1)
            self.head = torch.nn.Linear(int(encoder.config.hidden_size), 1)

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
            out = self.encoder(input_ids, attention_mask, token_type_ids)
            # proxy.semantic.bert's encoder returns the states; transformers' (training) an
            # object holding them
            states = out if isinstance(out, torch.Tensor) else out.last_hidden_state
            if self.mean_pool:  # the embedder's own pooling: what its pre-training shaped
                weights = attention_mask.unsqueeze(-1).to(states.dtype)
                pooled = (states * weights).sum(1) / weights.sum(1).clamp(min=1.0)
            else:
                pooled = states[:, 0]
            return self.head(self.dropout(pooled)).squeeze(-1)

    return _PairClassifier


class PairClassifier:
    """Factory for the torch module (a class built lazily so torch loads only on use)."""

    @staticmethod
    def from_pretrained_encoder(model_dir: Path, pool: Pool = "cls") -> Any:
        """MiniLM weights from ``model_dir`` plus a freshly initialised head (training)."""
        from transformers import BertModel

        encoder = BertModel.from_pretrained(
            str(model_dir), add_pooling_layer=False, local_files_only=True
        )
        return _make_class()(encoder, pool)

    @staticmethod
    def from_config_dict(config: dict[str, Any], pool: Pool = "cls") -> Any:
        """An untrained module of the shape ``config`` (a BERT config as a dict), on
        :mod:`proxy.semantic.bert`'s encoder (what the gateway runs: no ``transformers``)."""
        from proxy.semantic.bert import bert_encoder

        return _make_class()(bert_encoder(config), pool)


def pack_state(state: dict[str, np.ndarray], min_quantized: int = 4096) -> dict[str, np.ndarray]:
    """A state dict as shipped arrays: 2-D tensors of at least ``min_quantized``
    elements as int8 per row (symmetric, scale ``max|row| / 127`` stored float16 under
    ``NAME::scale``, rounded up where float16 rounds it down, so that no weight lands past
    127 steps and is clipped: a row under ~8e-3 has a subnormal float16 scale, up to a
    third off); everything else float32."""
    out: dict[str, np.ndarray] = {}
    for name, value in state.items():
        arr = np.asarray(value, dtype=np.float32)
        if arr.ndim == 2 and arr.size >= min_quantized:
            exact = np.abs(arr).max(axis=1) / np.float32(127.0)
            scale = exact.astype(np.float16)
            low = scale.astype(np.float32) < exact
            scale[low] = np.nextafter(scale[low], np.float16(np.inf))
            scale = np.maximum(scale, np.float16(2**-24))  # float16's least: all-zero rows
            step = scale.astype(np.float32)[:, None]
            out[name] = np.clip(np.rint(arr / step), -127, 127).astype(np.int8)
            out[name + SCALE_SUFFIX] = scale
        else:
            out[name] = arr
    return out


def unpack_state(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Inverse of :func:`pack_state` (int8 rows times their scales, as float32)."""
    out: dict[str, np.ndarray] = {}
    for name, value in arrays.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        scale = arrays.get(name + SCALE_SUFFIX)
        if scale is not None:
            out[name] = value.astype(np.float32) * scale.astype(np.float32)[:, None]
        else:
            out[name] = value.astype(np.float32)
    return out


@dataclass(frozen=True)
class CrossEncoderConfig:
    """What ``cross_encoder.json`` holds besides the weights."""

    bert: dict[str, Any]
    max_len: int
    platt_a: float  # calibrated probability = sigmoid(platt_a * logit + platt_b)
    platt_b: float
    threshold: float  # on the calibrated probability, chosen on the calib split
    min_similarity: float  # candidates below this cosine are not scored (recall-first)
    meta: dict[str, Any] = field(default_factory=dict)
    pool: Pool = "cls"

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CrossEncoderConfig:
        return cls(
            bert=dict(data["bert"]),
            max_len=int(data["max_len"]),
            platt_a=float(data["platt_a"]),
            platt_b=float(data["platt_b"]),
            threshold=float(data["threshold"]),
            min_similarity=float(data["min_similarity"]),
            meta=dict(data.get("meta", {})),
            pool="mean" if data.get("pool") == "mean" else "cls",
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "bert": self.bert,
            "max_len": self.max_len,
            "platt_a": self.platt_a,
            "platt_b": self.platt_b,
            "threshold": self.threshold,
            "min_similarity": self.min_similarity,
            "meta": self.meta,
            "pool": self.pool,
        }


def load_shipped(directory: Path | None = None) -> tuple[CrossEncoderConfig, dict[str, np.ndarray]]:
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
    return CrossEncoderConfig.from_json(json.loads(config_text)), arrays


def is_shipped() -> bool:
    """Whether the package carries cross-encoder weights."""
    base = resources.files("proxy.semantic.data")
    return base.joinpath(CONFIG_FILE).is_file() and base.joinpath(WEIGHTS_FILE).is_file()


class CrossEncoder:
    """Text pairs -> calibrated probability that the two are the same question."""

    def __init__(
        self,
        config: CrossEncoderConfig,
        arrays: dict[str, np.ndarray],
        *,
        precision: Precision = "int8",
        tokenizer_path: Path | None = None,
        trace: bool = True,
        threads: int | None = 1,
    ) -> None:
        import torch
        from tokenizers import Tokenizer

        from proxy.semantic.embedder import bundled_model_path

        self._config = config
        self._torch = torch
        self._precision = precision
        model = PairClassifier.from_config_dict(config.bert, config.pool)
        state = {k: torch.from_numpy(v) for k, v in unpack_state(arrays).items()}
        model.load_state_dict(state)
        model.eval()
        if precision == "int8":
            from proxy.semantic.rowquant import quantize_linears

            quantize_linears(model.encoder)
        self._model = model
        if trace and precision != "bf16":  # a TorchScript trace: the same sums, less Python
            self._model = _trace(model)
        path = tokenizer_path or bundled_model_path() / "tokenizer.json"
        tokenizer = Tokenizer.from_file(str(path))
        tokenizer.no_padding()
        tokenizer.enable_truncation(config.max_len)
        self._tokenizer = tokenizer
        self._lock = threading.Lock()  # the Rust tokenizer is not re-entrant across threads
        # torch intra-op threads of each calling thread, as the embedder's workers use
        # (None: torch's process-wide setting); two OpenMP threads on a busy 2-core
        # machine spin on each other, one thread per lookup does not
        self._threads = threads
        self._limited: set[int] = set()

    @property
    def config(self) -> CrossEncoderConfig:
        return self._config

    def logits(self, pairs: Sequence[tuple[str, str]]) -> np.ndarray:
        """Raw logits, one per ``(a, b)``; one forward pass per length bucket."""
        if not pairs:
            return np.zeros(0, dtype=np.float64)
        torch = self._torch
        if self._threads is not None and threading.get_ident() not in self._limited:
            from proxy.semantic.omp_threads import limit_this_thread

            limit_this_thread(self._threads)
            self._limited.add(threading.get_ident())
        with self._lock:
            encodings = self._tokenizer.encode_batch([(a, b) for a, b in pairs])
        ids = [e.ids for e in encodings]
        types = [e.type_ids for e in encodings]
        out = np.zeros(len(pairs), dtype=np.float64)
        chunks = [
            (length, idx[start : start + MAX_BATCH])
            for length, idx in length_groups([len(r) for r in ids], cap=self._config.max_len)
            for start in range(0, len(idx), MAX_BATCH)
        ]  # bounded batches: many pairs of one length would otherwise take gigabytes
        for length, idx in chunks:
            batch_ids, mask = pad_rows([ids[i] for i in idx], length)
            batch_types, _ = pad_rows([types[i] for i in idx], length)
            with torch.inference_mode(), torch.autocast(
                "cpu", dtype=torch.bfloat16, enabled=self._precision == "bf16"
            ):
                logits = self._model(
                    torch.tensor(batch_ids), torch.tensor(mask), torch.tensor(batch_types)
                )
            out[idx] = logits.float().numpy()
        return out

    def calibrate(self, logits: np.ndarray) -> np.ndarray:
        """Platt-scaled probabilities of raw logits."""
        z = self._config.platt_a * np.asarray(logits, dtype=np.float64) + self._config.platt_b
        return 1.0 / (1.0 + np.exp(-np.clip(z, -60.0, 60.0)))

    def probabilities(self, pairs: Sequence[tuple[str, str]]) -> np.ndarray:
        """Calibrated probabilities, one per pair."""
        return self.calibrate(self.logits(pairs))


def _trace(model: Any) -> Any:
    import warnings

    import torch

    ids = torch.tensor([[101, 2129, 2079, 1045, 102, 2129, 2064, 102], [101, 7592, 102] + [0] * 5])
    mask = (ids != 0).long()
    types = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0, 0]])
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")  # TracerWarnings about Python-side shape checks
        return torch.jit.trace(model, (ids, mask, types), check_trace=False)


def fit_platt(logits: np.ndarray, labels: np.ndarray, iterations: int = 50) -> tuple[float, float]:
    """Platt scaling: ``(a, b)`` maximising the likelihood of ``sigmoid(a * logit + b)``
    (Newton's method, with Platt's smoothed targets against overconfidence)."""
    x = np.asarray(logits, dtype=np.float64)
    y = np.asarray(labels, dtype=np.float64)
    positives, negatives = float(y.sum()), float(len(y) - y.sum())
    if positives == 0 or negatives == 0:
        raise ValueError("calibration needs both labels")
    t = np.where(y > 0, (positives + 1) / (positives + 2), 1 / (negatives + 2))

    def loss(a: float, b: float) -> float:
        z = a * x + b  # cross-entropy against the smoothed targets, computed stably
        return float(np.sum(np.logaddexp(0.0, z) - t * z))

    a, b = 0.0, float(np.log(positives / negatives))
    current = loss(a, b)
    for _ in range(iterations):
        p = 1.0 / (1.0 + np.exp(-np.clip(a * x + b, -60, 60)))
        g = np.array([np.sum((p - t) * x), np.sum(p - t)])
        w = p * (1 - p)
        h = np.array([[np.sum(w * x * x), np.sum(w * x)], [np.sum(w * x), np.sum(w)]])
        step = np.linalg.solve(h + np.eye(2) * 1e-9, g)
        size = 1.0
        while size > 1e-6:  # backtracking: Newton's full step can overshoot
            new = loss(a - size * float(step[0]), b - size * float(step[1]))
            if new <= current:
                break
            size /= 2
        a, b = a - size * float(step[0]), b - size * float(step[1])
        done = current - new < 1e-10 * max(1.0, abs(current))
        current = min(current, new)
        if done or math.hypot(*step) < 1e-10:
            break
    return a, b
