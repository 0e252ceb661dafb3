"""The workers' tokenizer, for a gateway in front of remote workers (no weights, no torch).

The prefix router can only match a worker's KV events if it hashes the very token
ids the worker's engine cached; for text and chat prompts that needs the workers'
tokenizer here. Choice (``kvtoll serve --tokenizer``):

* ``auto`` (default): by the served model name — ``kvtoll-tiny`` (the test model)
  uses the engine's :class:`~engine.tokenizer.ByteTokenizer`; the bundled model's
  name (the GGUF file's stem) uses that file's tokenizer; any other name: none;
* ``none``: no tokenizer (prompts are estimated, routing by text bytes);
* a path: a ``.gguf`` file or a Hugging Face model directory (``tokenizer.json``),
  read with the engine's own loaders (weights are not loaded).

Workers serving several different models cannot share one tokenizer: ``auto``
then loads none.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from gguf import GGUFReader

from engine.api import TINY_MODEL, Tokenizer
from engine.loader.bundled import bundled_model_path
from engine.loader.tokenizers import read_gguf_tokenizer, read_hf_tokenizer
from engine.tokenizer import ByteTokenizer

AUTO = "auto"
NONE = "none"


def tokenizer_from_path(path: Path) -> Tokenizer:
    """The tokenizer of a GGUF file or a safetensors/HF directory (``ValueError`` if
    neither)."""
    if path.is_dir():
        config = path / "config.json"
        cfg = json.loads(config.read_text()) if config.exists() else {}
        return read_hf_tokenizer(path, cfg)
    if path.suffix == ".gguf" and path.is_file():
        return read_gguf_tokenizer(GGUFReader(str(path)))
    raise ValueError(f"--tokenizer: {path} is neither a .gguf file nor a model directory")


def _bundled_name() -> str | None:
    try:
        return bundled_model_path().stem
    except FileNotFoundError:
        return None


def worker_tokenizer(models: Sequence[str], choice: str = AUTO) -> Tokenizer | None:
    """The tokenizer to count and route ``models``' prompts with (see module doc)."""
    if choice == NONE:
        return None
    if choice != AUTO:
        return tokenizer_from_path(Path(choice).expanduser())
    if len(set(models)) != 1:
        return None
    (model,) = set(models)
    if model == TINY_MODEL:
        return ByteTokenizer()
    if model == _bundled_name():
        return tokenizer_from_path(bundled_model_path())
    return None
