"""The cross-encoder model: MiniLM reading ``[CLS] a [SEP] b [SEP]``, a linear head on [CLS].

Torch (and transformers) are imported only inside this module's functions: importing
it costs nothing, building a :class:`PairClassifier` loads them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _torch_classes() -> tuple[Any, Any, Any]:
    import torch
    from transformers import BertConfig, BertModel

    return torch, BertConfig, BertModel


def _make_class() -> Any:
    torch, _, _ = _torch_classes()

    class _PairClassifier(torch.nn.Module):  # type: ignore[name-defined]
        def __init__(self, encoder: Any) -> None:
            super().__init__()
            self.encoder = encoder
            self.dropout = torch.nn.Dropout(0.1)
            self.head = torch.nn.Linear(int(encoder.config.hidden_size), 1)

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
            out = self.encoder(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            )
            cls = out.last_hidden_state[:, 0]
            return self.head(self.dropout(cls)).squeeze(-1)

    return _PairClassifier


class PairClassifier:
    """Factory for the torch module (a class built lazily so torch loads only on use)."""

    @staticmethod
    def from_pretrained_encoder(model_dir: Path) -> Any:
        """MiniLM weights from ``model_dir`` plus a freshly initialised head (training)."""
        _, _, bert_model = _torch_classes()
        encoder = bert_model.from_pretrained(
            str(model_dir), add_pooling_layer=False, local_files_only=True
        )
        return _make_class()(encoder)

    @staticmethod
    def from_config(config_path: Path) -> Any:
        """An untrained module of the shape in ``config_path`` (to load weights into)."""
        _, bert_config, bert_model = _torch_classes()
        encoder = bert_model(bert_config.from_json_file(str(config_path)), add_pooling_layer=False)
        return _make_class()(encoder)
