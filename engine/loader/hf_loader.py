"""Load a Hugging Face Llama checkpoint directory: config.json, *.safetensors,
tokenizer.json and the chat template from tokenizer_config.json."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file

from engine.loader.tokenizers import read_hf_tokenizer as read_tokenizer
from engine.model.config import LlamaConfig
from engine.tokenizer import TextTokenizer

log = logging.getLogger(__name__)


def load_hf_dir(path: Path) -> tuple[LlamaConfig, dict[str, torch.Tensor], TextTokenizer]:
    """Config, float32 HF-named weights and tokenizer of a safetensors directory."""
    cfg_json = json.loads((path / "config.json").read_text())
    arch = cfg_json.get("model_type", "llama")
    if arch != "llama":
        raise ValueError(f"unsupported model_type {arch!r} (only llama)")
    cfg = LlamaConfig.from_hf_dict(cfg_json)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {path}")
    state: dict[str, torch.Tensor] = {}
    for i, f in enumerate(files):
        state.update({k: v.float() for k, v in load_file(str(f)).items()})
        log.info("loading safetensors: %d/%d files", i + 1, len(files))
    return cfg, state, read_tokenizer(path, cfg_json)
