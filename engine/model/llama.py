"""Llama-family decoder over a paged KV cache: RMSNorm, RoPE, GQA, SwiGLU, tied
embeddings. Tokens arrive flattened (prefill chunks and decodes of many sequences
mixed); attention goes through an :class:`AttentionBackend`.

Parameter names follow Hugging Face (``model.layers.N.self_attn.o_proj``) except for
the projections stored stacked (:data:`STACKED`): q, k and v are one weight
``qkv_proj`` (rows q, then k, then v) and gate and up one ``gate_up_proj``, so a step
runs 4 matmuls per layer instead of 7. On CPU each call costs ~20 us on top of
streaming its weight (oneDNN, at any row count); with the bigger matrices the 30
layers of SmolLM2-135M ran 12.3 vs 14.3 ms at 1 row and 52 vs 58 ms at 512 rows
(bfloat16, AMX Xeon, 2 threads, weights not in cache). :func:`stack_checkpoint`
turns a checkpoint's separate weights into the stacked ones, and
:meth:`LlamaForCausalLM.checkpoint_state_dict` gives them back under their
checkpoint names.

On CPU, where the native kernels build (AVX-512), the runner passes them to
:meth:`LlamaForCausalLM.forward` (``fused``), which then runs the same computation with
the small ops fused (:mod:`engine.kernels.cpu_fused`): per layer 4 matmuls, attention
and 4 fused calls (RoPE + K/V write, residual add + RMSNorm twice, SiLU * up) instead
of ~30 torch ops, with the eager ops' results bit for bit. Where the gate/up projection
runs on a native GEMM kernel packed as pairs, SiLU * up runs in that kernel's epilogue
(the same values, without writing and re-reading the 2 x 1,536-wide product).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.kernels.cpu_fused import (
    FusedKernels,
    RopeRows,
    add_rmsnorm,
    plan_rope,
    rope_write_kv,
    silu_mul,
)
from engine.model.config import LlamaConfig
from engine.model.int8_linear import NativeInt8Linear
from engine.model.packed_linear import PackedLinear
from engine.model.rope import RotaryEmbedding, rotate

# Stacked projection -> the checkpoint projections it holds, in row order.
STACKED: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}

KVCache = tuple[torch.Tensor, torch.Tensor]
RopeTables = tuple[torch.Tensor, torch.Tensor]  # cos, sin [T, 1, head_dim]


# Gate/up layers that may compute SiLU(gate) * up themselves (their ``silu_mul``).
FUSED_SWIGLU = (PackedLinear, NativeInt8Linear)


@dataclass
class LayerState:
    """One step's forward between two of its layers (:meth:`LlamaForCausalLM.begin`,
    ``run_layers``, ``finish``): the residual stream ``h``; for eager ops the RoPE
    tables; for the fused kernels the kernels and their row plan, and ``x``, the next
    layer's normed input (after the last layer: the final-norm hidden states)."""

    h: torch.Tensor
    tables: RopeTables | None
    rope: RotaryEmbedding
    fused: tuple[FusedKernels, RopeRows] | None
    x: torch.Tensor | None


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
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.stacked_sizes = (q_size, kv_size, kv_size)  # rows of q, k, v in qkv_proj
        self.qk_size = q_size + kv_size  # q's and k's columns, adjacent: rotated together
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=False)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeTables,
        cache: KVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        qkv = self.qkv_proj(x)
        qk = rotate(qkv[:, : self.qk_size].view(t, h + self.num_kv_heads, d), *rope)
        q, k = qk[:, :h], qk[:, h:]  # views of the one rotation
        v = qkv[:, self.qk_size :].view(t, self.num_kv_heads, d)
        backend.write_kv(k, v, cache[0], cache[1], meta.slot_mapping)
        o = backend.forward(q, cache[0], cache[1], meta, self.scale)
        return self.o_proj(o.reshape(t, h * d))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.stacked_sizes = (cfg.intermediate_size, cfg.intermediate_size)  # gate, up
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.stacked_sizes, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


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
        # nn.Embedding's own init, except on the meta device (a checkpoint's skeleton,
        # engine.factory): normal_ on a meta tensor runs torch's Python reference, whose
        # first call imports torch._dynamo, 2-3 s of every worker's start for nothing.
        weight = torch.empty(cfg.vocab_size, cfg.hidden_size)
        if not weight.is_meta:
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=weight)
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
        fused: FusedKernels | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states [T, hidden] of the flattened tokens; ``fused``: the
        CPU's fused small ops (:mod:`engine.kernels.cpu_fused`), None for eager ops."""
        state = self.begin(input_ids, positions, rope, meta, fused)
        self.run_layers(state, kv_caches, meta, backend, 0, self.num_layers)
        return self.finish(state)

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def begin(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        meta: AttentionMetadata,
        fused: FusedKernels | None = None,
    ) -> LayerState:
        """The token embeddings and what every layer of the step reads (RoPE tables, or
        the fused kernels' row plan, once per step): what :meth:`run_layers` starts from."""
        h = self.model.embed_tokens(input_ids)
        if fused is None:
            return LayerState(h, rope.tables(positions), rope, None, None)
        x = torch.empty_like(h)
        first = cast("LlamaDecoderLayer", self.model.layers[0]).input_layernorm
        add_rmsnorm(fused, None, h, first.weight, first.eps, x)
        return LayerState(h, None, rope, (fused, plan_rope(positions, meta.slot_mapping)), x)

    def run_layers(
        self,
        state: LayerState,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        start: int,
        stop: int,
    ) -> None:
        """Advance ``state`` through layers ``start`` .. ``stop - 1`` (each writes its
        K/V). A step may run its layers in several calls, with other steps between them
        (:class:`engine.runner.StagedForward`): a layer reads only its own cache, the
        metadata passed in and ``state``."""
        layers = cast("list[LlamaDecoderLayer]", list(self.model.layers))
        if state.fused is None:
            assert state.tables is not None
            for i in range(start, stop):
                state.h = layers[i](state.h, state.tables, kv_caches[i], meta, backend)
            return
        self._fused_layers(state, layers, kv_caches, meta, backend, start, stop)

    def _fused_layers(
        self,
        state: LayerState,
        layers: list[LlamaDecoderLayer],
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        start: int,
        stop: int,
    ) -> None:
        """:meth:`run_layers` with the fused kernels. The residual stream ``state.h`` is
        updated in place; ``state.x`` holds each norm's output (the next matmul's input).
        A layer's closing residual add runs with the next layer's input norm (the last
        with the final norm), so between two layers ``x`` is already the next one's
        input. K/V go straight into the caches (the layout of
        :mod:`engine.attention.base`), so ``backend.write_kv`` is not called."""
        assert state.fused is not None and state.x is not None
        kernels, rows = state.fused
        h, x, rope = state.h, state.x, state.rope
        t = h.shape[0]
        for i in range(start, stop):
            layer, cache = layers[i], kv_caches[i]
            attn, mlp = layer.self_attn, layer.mlp
            qkv = attn.qkv_proj(x)
            rope_write_kv(kernels, qkv, attn.num_heads, rows, rope.cos, rope.sin, *cache)
            q = qkv[:, : attn.num_heads * attn.head_dim].view(t, attn.num_heads, attn.head_dim)
            o = backend.forward(q, cache[0], cache[1], meta, attn.scale)
            post = layer.post_attention_layernorm
            add_rmsnorm(kernels, attn.o_proj(o.reshape(t, -1)), h, post.weight, post.eps, x)
            gate_up = mlp.gate_up_proj  # SiLU * up inside its native kernel where it can
            act = gate_up.silu_mul(x) if isinstance(gate_up, FUSED_SWIGLU) else None
            if act is None:
                act = silu_mul(kernels, gate_up(x))
            norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            add_rmsnorm(kernels, mlp.down_proj(act), h, norm.weight, norm.eps, x)

    def finish(self, state: LayerState) -> torch.Tensor:
        """The final-norm hidden states once every layer has run (the fused path's last
        layer already wrote them into ``x``)."""
        if state.x is not None:
            return state.x
        return cast("torch.Tensor", self.model.norm(state.h))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, vocab] for the selected hidden rows."""
        return self.lm_head(hidden).float()

    def checkpoint_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under their checkpoint (Hugging Face) names: each stacked
        projection split back into its parts (views, no copies)."""
        state = self.state_dict()
        for i, layer in enumerate(self.model.layers):
            assert isinstance(layer, LlamaDecoderLayer)
            sizes = {
                "self_attn.qkv_proj": layer.self_attn.stacked_sizes,
                "mlp.gate_up_proj": layer.mlp.stacked_sizes,
            }
            for stacked, parts in STACKED.items():
                rows = state.pop(f"model.layers.{i}.{stacked}.weight").split(sizes[stacked])
                for part, weight in zip(parts, rows, strict=True):
                    state[f"model.layers.{i}.{part}.weight"] = weight
        return state


def stack_checkpoint(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (checkpoint names) with each layer's separate projections replaced by
    their stacked weight (:data:`STACKED`); other entries unchanged. A layer that has
    some parts of a stacked projection but not all is an error."""
    out = dict(state)
    for name in state:
        for stacked, parts in STACKED.items():
            if not name.endswith(f".{parts[0]}.weight"):
                continue
            prefix = name.removesuffix(f"{parts[0]}.weight")
            keys = [f"{prefix}{part}.weight" for part in parts]
            missing = [k for k in keys if k not in state]
            if missing:
                raise ValueError(f"checkpoint has {name} but not {missing[0]}")
            out[f"{prefix}{stacked}.weight"] = torch.cat([out.pop(k) for k in keys])
    return out
