"""Llama-family decoder over a paged KV cache: RMSNorm, RoPE, GQA, SwiGLU, tied
embeddings. Parameter names follow Hugging Face (``model.layers.N.self_attn.q_proj``)
so a HF state dict loads as is. Tokens arrive flattened (prefill chunks and decodes
of many sequences mixed); attention goes through an :class:`AttentionBackend`.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.model.config import LlamaConfig
from engine.model.rope import RotaryEmbedding, rotate

KVCache = tuple[torch.Tensor, torch.Tensor]
RopeTables = tuple[torch.Tensor, torch.Tensor]  # cos, sin [T, 1, head_dim]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_size
        self.scale = self.head_dim**-0.5
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeTables,
        cache: KVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        t = x.shape[0]
        q = rotate(self.q_proj(x).view(t, self.num_heads, self.head_dim), *rope)
        k = rotate(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim), *rope)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        backend.write_kv(k, v, cache[0], cache[1], meta.slot_mapping)
        o = backend.forward(q, cache[0], cache[1], meta, self.scale)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor,
        rope: RopeTables,
        cache: KVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), rope, cache, meta, backend)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaBody(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The decoder plus LM head; :meth:`forward` returns hidden states, not logits."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaBody(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Final-norm hidden states [T, hidden] of the flattened tokens."""
        h = self.model.embed_tokens(input_ids)
        tables = rope.tables(positions)  # once per step, not per layer
        for layer, cache in zip(self.model.layers, kv_caches, strict=True):
            h = layer(h, tables, cache, meta, backend)
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, vocab] for the selected hidden rows."""
        return self.lm_head(hidden).float()
