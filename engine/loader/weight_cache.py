"""Dequantized GGUF weights kept between starts, so a second start skips dequantizing.

Parsing the bundled SmolLM2 GGUF and dequantizing it (Q4_1) to float32 takes most of a
first start on a CPU; reading the float32 tensors, the config and the tokenizer back
from one safetensors file (the last two in its string metadata) is much faster. The
file lives in ``$XDG_CACHE_HOME/kvtoll/weights`` (default
``~/.cache/kvtoll/weights``), named by the GGUF file's stem and a hash of its
resolved path, size, modification time and :data:`FORMAT_VERSION`, so an edited or
replaced model is read afresh. An unreadable or unwritable cache only costs the time:
the weights are then read from the GGUF file as before.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

log = logging.getLogger(__name__)

# Bump when what a loader stores changes (tensor names, layout, dtype; metadata keys).
FORMAT_VERSION = 2
Loaded = tuple[dict[str, torch.Tensor], dict[str, str]]  # tensors, string metadata


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/kvtoll/weights``, else ``~/.cache/kvtoll/weights``."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "kvtoll" / "weights"


def cache_file(model: Path, cache_dir: Path) -> Path:
    """Where the weights of ``model`` (its current contents) are cached."""
    stat = model.stat()
    key = f"{model.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{FORMAT_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir / f"{model.stem}-{digest}.safetensors"


def cached_weights(
    model: Path, read: Callable[[], Loaded], cache_dir: Path | None = None
) -> Loaded:
    """The tensors and metadata of ``model``: from the cache if present, else ``read()``
    (then cached). Metadata is what the loader needs besides the tensors (config,
    tokenizer) as strings, so a cached start never parses the model file."""
    target = cache_file(model, cache_dir or default_cache_dir())
    if target.exists():
        try:
            with safe_open(str(target), framework="pt") as cached:
                metadata = dict(cached.metadata() or {})
                state = {name: cached.get_tensor(name) for name in cached.keys()}  # noqa: SIM118
            log.info("weights of %s read from the cache %s", model.name, target)
            return state, metadata
        except (OSError, ValueError, RuntimeError, SafetensorError) as exc:  # truncated file
            log.warning("ignoring the weight cache %s: %s", target, exc)
    state, metadata = read()
    _store(state, metadata, target)
    return state, metadata


def _store(state: dict[str, torch.Tensor], metadata: dict[str, str], target: Path) -> None:
    """Write atomically (aside, then renamed) so a reader never sees half a file."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, aside = tempfile.mkstemp(dir=target.parent, suffix=".tmp")
        os.close(fd)
        try:
            save_file({k: v.contiguous() for k, v in state.items()}, aside, metadata=metadata)
            os.replace(aside, target)
        finally:
            Path(aside).unlink(missing_ok=True)
        log.info("weights cached in %s for the next start", target)
    except (OSError, RuntimeError, SafetensorError) as exc:
        log.warning("cannot cache the weights in %s: %s", target.parent, exc)
