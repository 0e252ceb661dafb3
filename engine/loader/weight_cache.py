"""Dequantized GGUF weights kept between starts, so a second start skips dequantizing.

Dequantizing the bundled SmolLM2 GGUF (Q4_1) to float32 takes most of a first start on
a CPU (~15 s on 2 cores); reading the float32 tensors back from a safetensors file
takes about a second. The file lives in ``$XDG_CACHE_HOME/kvtoll/weights`` (default
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
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

log = logging.getLogger(__name__)

# Bump when what read_weights produces changes (names, layout, dtype).
FORMAT_VERSION = 1


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
    model: Path, read: Callable[[], dict[str, torch.Tensor]], cache_dir: Path | None = None
) -> dict[str, torch.Tensor]:
    """The weights of ``model``: from the cache if present, else ``read()`` and cached."""
    target = cache_file(model, cache_dir or default_cache_dir())
    if target.exists():
        try:
            state = load_file(target)
            log.info("weights of %s read from the cache %s", model.name, target)
            return state
        except (OSError, ValueError, RuntimeError, SafetensorError) as exc:  # truncated file
            log.warning("ignoring the weight cache %s: %s", target, exc)
    state = read()
    _store(state, target)
    return state


def _store(state: dict[str, torch.Tensor], target: Path) -> None:
    """Write atomically (aside, then renamed) so a reader never sees half a file."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, aside = tempfile.mkstemp(dir=target.parent, suffix=".tmp")
        os.close(fd)
        try:
            save_file({k: v.contiguous() for k, v in state.items()}, aside)
            os.replace(aside, target)
        finally:
            Path(aside).unlink(missing_ok=True)
        log.info("weights cached in %s for the next start", target)
    except (OSError, RuntimeError, SafetensorError) as exc:
        log.warning("cannot cache the weights in %s: %s", target.parent, exc)
