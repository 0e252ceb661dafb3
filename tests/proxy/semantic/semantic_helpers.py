"""Request and response bodies for the semantic-cache tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def chat(
    text: str, *history: dict[str, str], model: str = "smollm2", **params: object
) -> dict[str, object]:
    """A chat body at temperature 0 whose last user turn is ``text``."""
    body: dict[str, object] = {
        "model": model,
        "temperature": 0,
        "messages": [*history, {"role": "user", "content": text}],
    }
    body.update(params)
    return body


def answer(text: str, finish_reason: str = "stop") -> dict[str, object]:
    """A chat completion response as the proxy would store it."""
    return {
        "object": "chat.completion",
        "model": "smollm2",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish_reason,
            }
        ],
        "usage": {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17},
    }


class Renamed:
    """A real embedder under another name: what a replica running another model (or
    other weights) looks like to the store, with vectors that would otherwise match."""

    def __init__(self, inner: Any, name: str) -> None:
        self._inner = inner
        self._name = name

    @property
    def dim(self) -> int:
        return int(self._inner.dim)

    @property
    def name(self) -> str:
        return self._name

    def embed(self, texts: Sequence[str]) -> Any:
        return self._inner.embed(texts)
