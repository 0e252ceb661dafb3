"""Stacked projections: a checkpoint's q/k/v and gate/up weights load into one weight
each, come back out under their checkpoint names unchanged, and compute what the
separate projections compute."""

from __future__ import annotations

import pytest
import torch

from engine.factory import tiny_llama_config
from engine.model.llama import LlamaForCausalLM, stack_checkpoint


def _checkpoint(seed: int = 0) -> dict[str, torch.Tensor]:
    """A random checkpoint under Hugging Face names (separate projections)."""
    cfg = tiny_llama_config()
    gen = torch.Generator().manual_seed(seed)
    shapes = {
        "q_proj": (cfg.num_attention_heads * cfg.head_size, cfg.hidden_size),
        "k_proj": (cfg.num_key_value_heads * cfg.head_size, cfg.hidden_size),
        "v_proj": (cfg.num_key_value_heads * cfg.head_size, cfg.hidden_size),
        "o_proj": (cfg.hidden_size, cfg.num_attention_heads * cfg.head_size),
    }
    mlp = {
        "gate_proj": (cfg.intermediate_size, cfg.hidden_size),
        "up_proj": (cfg.intermediate_size, cfg.hidden_size),
        "down_proj": (cfg.hidden_size, cfg.intermediate_size),
    }
    state = {
        "model.embed_tokens.weight": torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen),
        "model.norm.weight": torch.rand(cfg.hidden_size, generator=gen),
    }
    for i in range(cfg.num_hidden_layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            state[f"model.layers.{i}.{norm}.weight"] = torch.rand(cfg.hidden_size, generator=gen)
        for group, parts in (("self_attn", shapes), ("mlp", mlp)):
            for name, shape in parts.items():
                state[f"model.layers.{i}.{group}.{name}.weight"] = torch.randn(shape, generator=gen)
    return state


def _model(state: dict[str, torch.Tensor]) -> LlamaForCausalLM:
    model = LlamaForCausalLM(tiny_llama_config())
    missing, unexpected = model.load_state_dict(stack_checkpoint(state), strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied to the embedding below
    model.lm_head.weight = model.model.embed_tokens.weight
    return model


def test_stacked_weights_round_trip_to_checkpoint_names() -> None:
    state = _checkpoint()
    model = _model(state)
    names = set(model.state_dict())
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert not any(n.endswith(("q_proj.weight", "gate_proj.weight")) for n in names)
    back = model.checkpoint_state_dict()
    assert set(back) == set(state) | {"lm_head.weight"}
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name


def test_stacked_projections_compute_the_separate_ones() -> None:
    state = _checkpoint(1)
    layer = _model(state).model.layers[1]
    x = torch.randn(5, tiny_llama_config().hidden_size)
    qkv = layer.self_attn.qkv_proj(x)
    separate = [x @ state[f"model.layers.1.self_attn.{p}_proj.weight"].T for p in "qkv"]
    torch.testing.assert_close(qkv, torch.cat(separate, dim=-1))
    gate = x @ state["model.layers.1.mlp.gate_proj.weight"].T
    up = x @ state["model.layers.1.mlp.up_proj.weight"].T
    down = state["model.layers.1.mlp.down_proj.weight"]
    expected = (torch.nn.functional.silu(gate) * up) @ down.T
    torch.testing.assert_close(layer.mlp(x), expected)


def test_a_checkpoint_missing_part_of_a_stack_is_refused() -> None:
    state = _checkpoint()
    del state["model.layers.1.self_attn.v_proj.weight"]
    with pytest.raises(ValueError, match="v_proj"):
        stack_checkpoint(state)
