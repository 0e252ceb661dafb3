"""Load a Hugging Face Llama checkpoint directory: config.json, *.safetensors,
tokenizer.json and the chat template from tokenizer_config.json."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer as HFTokenizer

from engine.model.config import LlamaConfig
from engine.tokenizer import ChatTemplate, TextTokenizer

log = logging.getLogger(__name__)


def _token_text(value: object) -> str:
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return str(value or "")


def read_tokenizer(path: Path, cfg_json: dict[str, object]) -> TextTokenizer:
    """tokenizer.json + tokenizer_config.json (chat template, special tokens)."""
    tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
    tc_path = path / "tokenizer_config.json"
    tc: dict[str, object] = json.loads(tc_path.read_text()) if tc_path.exists() else {}
    bos, eos = _token_text(tc.get("bos_token")), _token_text(tc.get("eos_token"))
    eos_ids: list[int] = []
    raw = cfg_json.get("eos_token_id")
    if isinstance(raw, int):
        eos_ids.append(raw)
    elif isinstance(raw, list):
        eos_ids.extend(int(x) for x in raw)
    eos_id = tok.token_to_id(eos) if eos else None
    if eos_id is not None and eos_id not in eos_ids:
        eos_ids.append(eos_id)
    template = tc.get("chat_template")
    return TextTokenizer(
        tok, ChatTemplate(template if isinstance(template, str) else None, bos, eos), tuple(eos_ids)
    )


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
