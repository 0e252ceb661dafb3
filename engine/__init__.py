"""kvtoll engine: paged KV cache, automatic prefix caching, continuous batching.

Public entry points (import the modules; nothing is loaded at import time)::

    from engine.config import EngineConfig            # frozen config; EngineConfig.tiny() for tests
    from engine.factory import build_engine           # -> engine.async_engine.AsyncEngine
    from engine.factory import build_llm_engine       # -> engine.llm_engine.LLMEngine (sync step())
    from engine.factory import load_model             # reuse weights across engines in tests

Layers: ``scheduler`` (who runs) -> ``kv.kv_manager`` / ``kv.block_pool`` (blocks,
ref counts, prefix hashes) -> ``runner`` (tensors, KV cache) -> ``model.llama`` ->
``attention`` backends. The caller-facing types live in :mod:`engine.api`.
"""
