"""Load a Llama-architecture GGUF file: config, dequantized weights, tokenizer.

GGUF stores llama Q/K projection rows permuted for its own rope kernel
(``convert_hf_to_gguf.py``: ``w.reshape(H, 2, D/2, in).swapaxes(1, 2)``); we apply the
inverse so weights are in Hugging Face layout and the rotate-half rope applies.
Tensor names are mapped to HF names. Quantized tensors (Q4_1, Q8_0, ...) are
dequantized with ``gguf.quants.dequantize``. The tokenizer (``tokenizer.ggml.*``,
model ``gpt2`` = byte-level BPE) and the chat template come from the metadata.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from engine.loader.tokenizers import field as _field
from engine.loader.tokenizers import gguf_tokenizer_parts, tokenizer_from_parts
from engine.loader.weight_cache import cached_weights
from engine.model.config import LlamaConfig
from engine.tokenizer import TextTokenizer

log = logging.getLogger(__name__)

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def read_config(reader: GGUFReader) -> LlamaConfig:
    """Architecture hyper-parameters from ``llama.*`` metadata."""
    arch = str(_field(reader, "general.architecture"))
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r} (only llama)")
    tokens = reader.fields["tokenizer.ggml.tokens"]
    names = {t.name for t in reader.tensors}
    return LlamaConfig(
        vocab_size=int(_field(reader, "llama.vocab_size", len(tokens.data))),  # type: ignore[call-overload]
        hidden_size=int(_field(reader, "llama.embedding_length")),  # type: ignore[call-overload]
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),  # type: ignore[call-overload]
        num_hidden_layers=int(_field(reader, "llama.block_count")),  # type: ignore[call-overload]
        num_attention_heads=int(_field(reader, "llama.attention.head_count")),  # type: ignore[call-overload]
        num_key_value_heads=int(_field(reader, "llama.attention.head_count_kv")),  # type: ignore[call-overload]
        max_position_embeddings=int(_field(reader, "llama.context_length", 2048)),  # type: ignore[call-overload]
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),  # type: ignore[arg-type]
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),  # type: ignore[arg-type]
        tie_word_embeddings="output.weight" not in names,
    )


def hf_name(gguf_name: str) -> str:
    """HF parameter name of a GGUF tensor name (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``)."""
    base, _, suffix = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, idx, part = base.split(".", 2)
        return f"model.layers.{idx}.{_LAYER_NAMES[part]}.{suffix}"
    return f"{_TOP_NAMES[base]}.{suffix}"


def unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: back to HF rotate-half layout."""
    out_dim = w.shape[0]
    return (
        w.reshape(num_heads, out_dim // num_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def read_weights(reader: GGUFReader, cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """Dequantized float32 weights keyed by HF names (logs progress)."""
    state: dict[str, torch.Tensor] = {}
    total = len(reader.tensors)
    for i, t in enumerate(reader.tensors):
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        w = w.reshape([int(d) for d in reversed(t.shape)])
        name = hf_name(t.name)
        if name.endswith("q_proj.weight"):
            w = unpermute(w, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            w = unpermute(w, cfg.num_key_value_heads)
        state[name] = torch.from_numpy(np.array(w, dtype=np.float32, order="C"))
        if (i + 1) % 40 == 0 or i + 1 == total:
            log.info("loading GGUF weights: %d/%d tensors", i + 1, total)
    return state


def load_gguf(
    path: Path, cache_dir: Path | None = None
) -> tuple[LlamaConfig, dict[str, torch.Tensor], TextTokenizer]:
    """Config, float32 HF-named weights and tokenizer of a GGUF file; all three come
    from the copy a previous start cached (:mod:`.weight_cache`) if there is one."""
    log.info("reading GGUF %s", path)

    def read() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        reader = GGUFReader(str(path))
        cfg = read_config(reader)
        metadata = {"config": json.dumps(dataclasses.asdict(cfg)),
                    "tokenizer": json.dumps(gguf_tokenizer_parts(reader))}
        return read_weights(reader, cfg), metadata

    state, metadata = cached_weights(path, read, cache_dir)
    try:
        cfg = LlamaConfig(**json.loads(metadata["config"]))
        tok = tokenizer_from_parts(json.loads(metadata["tokenizer"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"the weight cache of {path} is unreadable ({exc}): delete it") from exc
    return cfg, state, tok
