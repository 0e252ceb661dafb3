"""An engine in this process (``kvtoll serve`` without ``--worker``): the one place the
gateway starts the engine, so torch and the model load only there."""

from __future__ import annotations

from typing import Protocol

from engine.api import AsyncEngineClient
from kvtoll.settings import Settings


class LocalEngine(AsyncEngineClient, Protocol):
    """An in-process engine: the client API plus a stop for its step thread."""

    def shutdown(self) -> None: ...


def start_local_engine(settings: Settings) -> LocalEngine:
    """Load the model named by ``settings`` and start its engine (``ValueError`` or
    ``OSError`` name what is wrong with the settings or the model files)."""
    from engine.cli import engine_config
    from engine.factory import build_engine

    config = engine_config(settings.model_path, settings.dtype,
                           attention_backend=settings.attention_backend,
                           device=settings.device, cuda_graphs=settings.cuda_graphs,
                           gpu_memory_utilization=settings.gpu_memory_utilization)
    return build_engine(config)
