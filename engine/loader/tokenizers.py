"""Tokenizers from model files, without the weights (and without torch).

The gateway reads its workers' tokenizer through these (``engine.api.tokenizers``) so
its block hashes match theirs; the weight loaders (``gguf_loader``, ``hf_loader``)
use them too.
"""

from __future__ import annotations

import json
from pathlib import Path

from gguf import GGUFReader
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from engine.tokenizer import ChatTemplate, TextTokenizer

_CONTROL, _USER_DEFINED = 3, 4


def field(reader: GGUFReader, key: str, default: object = None) -> object:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_gguf_tokenizer(reader: GGUFReader) -> TextTokenizer:
    """Byte-level BPE tokenizer, EOS ids and chat template from GGUF metadata."""
    return tokenizer_from_parts(gguf_tokenizer_parts(reader))


def gguf_tokenizer_parts(reader: GGUFReader) -> dict[str, object]:
    """What :func:`tokenizer_from_parts` needs, as JSON-able values (the tokenizer in
    ``tokenizers``' own serialization), read from GGUF metadata."""
    kind = str(field(reader, "tokenizer.ggml.model"))
    if kind != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (only gpt2 byte-level BPE)")
    tokens = [str(t) for t in field(reader, "tokenizer.ggml.tokens")]  # type: ignore[attr-defined]
    types = list(field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))  # type: ignore[call-overload]
    merges = [tuple(str(m).split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges")]  # type: ignore[attr-defined]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))  # type: ignore[arg-type]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    specials = [t for t, ty in zip(tokens, types, strict=True) if ty in (_CONTROL, _USER_DEFINED)]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    eos = int(field(reader, "tokenizer.ggml.eos_token_id", 0))  # type: ignore[call-overload]
    bos = field(reader, "tokenizer.ggml.bos_token_id")
    return {
        "tokenizer": tok.to_str(),
        "chat_template": str(field(reader, "tokenizer.chat_template", "")) or None,
        "bos_token": tokens[int(bos)] if bos is not None else "",  # type: ignore[call-overload]
        "eos_token": tokens[eos],
        "eos_token_ids": [eos],
    }


def tokenizer_from_parts(parts: dict[str, object]) -> TextTokenizer:
    """The tokenizer :func:`gguf_tokenizer_parts` describes."""
    template = ChatTemplate(parts["chat_template"],  # type: ignore[arg-type]
                            bos_token=str(parts["bos_token"]), eos_token=str(parts["eos_token"]))
    eos_ids = tuple(int(i) for i in parts["eos_token_ids"])  # type: ignore[attr-defined]
    return TextTokenizer(HFTokenizer.from_str(str(parts["tokenizer"])), template, eos_ids)


def _token_text(value: object) -> str:
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return str(value or "")


def read_hf_tokenizer(path: Path, cfg_json: dict[str, object]) -> TextTokenizer:
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
