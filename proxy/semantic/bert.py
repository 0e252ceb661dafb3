"""A BERT encoder (MiniLM's architecture) in plain torch, for the semantic layer's models
at run time: the pair encoder (:mod:`proxy.semantic.pair_encoder`) and the cross-encoder
(:mod:`proxy.semantic.cross_encoder`).

Its parameters carry the names of ``transformers``' ``BertModel(add_pooling_layer=False)``
so the shipped state dicts load as they are, and its arithmetic is that model's, op for
op (embeddings summed word + token type, then position; post-norm layers; exact-erf
GELU; torch's fused attention with a boolean padding mask), so a text's vector is the
same bit for bit (tests/proxy/semantic/test_bert.py). Loading the semantic cache with
``transformers``' BERT took 5.4-6.4 s and 694 MB peak RSS (2-core Xeon); with this,
2.3-2.5 s and 470 MB. Training (``bench/train_*``) still starts from ``transformers``.

Torch is imported only inside :func:`bert_encoder`: importing this module loads nothing.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


def bert_encoder(config: dict[str, Any]) -> Any:
    """An untrained encoder of the shape ``config`` (a BERT config as a dict, as
    ``config.json`` holds it), in eval mode. ``forward(input_ids, attention_mask,
    token_type_ids=None)`` returns the last hidden states [batch, tokens, hidden]."""
    import torch
    from torch import nn
    from torch.nn import functional

    if config.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"only BERT's exact GELU is built, not {config['hidden_act']!r}")
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError("only absolute position embeddings are built")
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    if hidden % heads:
        raise ValueError(f"hidden_size {hidden} is not a multiple of {heads} heads")
    inner, eps = int(config["intermediate_size"]), float(config["layer_norm_eps"])
    head_dim = hidden // heads

    class Embeddings(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.word_embeddings = nn.Embedding(int(config["vocab_size"]), hidden,
                                                padding_idx=config.get("pad_token_id"))  # fmt: skip
            self.position_embeddings = nn.Embedding(int(config["max_position_embeddings"]),
                                                    hidden)  # fmt: skip
            self.token_type_embeddings = nn.Embedding(int(config.get("type_vocab_size", 2)),
                                                      hidden)  # fmt: skip
            self.LayerNorm = nn.LayerNorm(hidden, eps=eps)

        def forward(self, ids: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
            positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
            summed = self.word_embeddings(ids) + self.token_type_embeddings(types)
            return self.LayerNorm(summed + self.position_embeddings(positions))

    class SelfAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.query = nn.Linear(hidden, hidden)
            self.key = nn.Linear(hidden, hidden)
            self.value = nn.Linear(hidden, hidden)

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            shape = (*x.shape[:-1], heads, head_dim)
            q = self.query(x).view(shape).transpose(1, 2)
            k = self.key(x).view(shape).transpose(1, 2)
            v = self.value(x).view(shape).transpose(1, 2)
            out = functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                          scale=head_dim**-0.5)  # fmt: skip
            return out.transpose(1, 2).contiguous().reshape(*x.shape[:-1], hidden)

    class DenseNorm(nn.Module):  # BertSelfOutput and BertOutput: dense, residual, norm
        def __init__(self, inputs: int) -> None:
            super().__init__()
            self.dense = nn.Linear(inputs, hidden)
            self.LayerNorm = nn.LayerNorm(hidden, eps=eps)

        def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
            return self.LayerNorm(self.dense(x) + residual)

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.self = SelfAttention()
            self.output = DenseNorm(hidden)

    class Intermediate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.dense = nn.Linear(hidden, inner)

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention = Attention()
            self.intermediate = Intermediate()
            self.output = DenseNorm(inner)

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            attended = self.attention.output(self.attention.self(x, mask), x)
            up = functional.gelu(self.intermediate.dense(attended))
            return self.output(up, attended)

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.ModuleList(Layer() for _ in range(int(config["num_hidden_layers"])))

    class Bert(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = SimpleNamespace(hidden_size=hidden)
            self.embeddings = Embeddings()
            self.encoder = Encoder()

        def forward(
            self,
            input_ids: torch.Tensor,
            attention_mask: torch.Tensor,
            token_type_ids: torch.Tensor | None = None,
        ) -> torch.Tensor:
            types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
            x = self.embeddings(input_ids, types)
            length = input_ids.shape[1]  # a key is seen where its token is not padding
            mask = attention_mask.bool()[:, None, None, :].expand(-1, 1, length, length)
            for layer in self.encoder.layer:
                x = layer(x, mask)
            return x

    return Bert().eval()
