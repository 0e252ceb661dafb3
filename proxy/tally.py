"""Running totals of one response's stream: text per choice, finish reasons, usage.

The prompt's token count and prefix-cached part, when the upstream sends them on
its first delta (kvtoll engines and workers), are known before the usage item: the
``x-kvtoll-cache`` header of a streamed response and the bill of a request whose
usage never arrives use them.

When the upstream's usage item never arrives (client gone, upstream died mid-way)
the completion tokens are recounted from what was received (text, and tool calls'
names and arguments): exactly with the tokenizer when the gateway has one, else one
token per non-empty delta (engines send one delta per decoded token or fewer, so
this never over-bills).

Tool calls stream as OpenAI's deltas (``{"index", "id", "type", "function": {"name",
"arguments"}}``, each piece once; a whole message's list has no ``index``: its
position is used): per choice and tool index, ``id``, ``type`` and
``name`` are taken from the first delta carrying them and ``arguments`` is the
concatenation of every piece (what OpenAI's SDK rebuilds).
"""

from __future__ import annotations

import time
from typing import Any

from engine.api import Tokenizer
from kvtoll.openai.responses import ChoiceResult
from proxy.upstream.base import UpstreamDelta, UpstreamUsage

Item = UpstreamDelta | UpstreamUsage


class Tally:
    """Accumulates the items of one response (see module doc)."""

    def __init__(self, tokenizer: Tokenizer | None = None) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, list[str]] = {}
        self._finish: dict[int, str | None] = {}
        self._logprobs: dict[int, dict[str, Any]] = {}
        self._tool_calls: dict[int, dict[int, dict[str, Any]]] = {}  # choice -> index -> call
        self._num_text_deltas = 0
        self.usage: UpstreamUsage | None = None
        self.first_token_at: float | None = None
        self.prompt_tokens: int | None = None  # as the upstream counted them before usage
        self.cached_tokens: int | None = None  # ... and their prefix-cached part

    def note_prompt(self, item: Item) -> None:
        """Record the prompt counts a delta carries (idempotent; :meth:`add` does it too)."""
        if isinstance(item, UpstreamDelta) and item.cached_tokens is not None:
            self.prompt_tokens = item.prompt_tokens
            self.cached_tokens = item.cached_tokens

    def prompt_cached(self) -> int:
        """Prefix-cached prompt tokens: reported in the usage, else by the deltas."""
        if self.usage is not None:
            return self.usage.cached_tokens
        return self.cached_tokens or 0

    def add(self, item: Item) -> None:
        """Fold one upstream item into the totals."""
        if isinstance(item, UpstreamUsage):
            self.usage = item
            return
        self.note_prompt(item)
        self._texts.setdefault(item.index, [])
        if item.text or item.tool_calls:
            if item.text:
                self._texts[item.index].append(item.text)
            if item.tool_calls:
                self._add_tool_calls(item.index, item.tool_calls)
            self._num_text_deltas += 1
            if self.first_token_at is None:
                self.first_token_at = time.perf_counter()
        if item.finish_reason is not None:
            self._finish[item.index] = item.finish_reason
        if item.logprobs:
            merged = self._logprobs.setdefault(item.index, {})
            for name, value in item.logprobs.items():
                if isinstance(value, list):
                    merged.setdefault(name, []).extend(value)
                else:
                    merged.setdefault(name, value)

    def _add_tool_calls(self, index: int, deltas: list[dict[str, Any]]) -> None:
        calls = self._tool_calls.setdefault(index, {})
        for position, delta in enumerate(deltas):
            call = calls.setdefault(int(delta.get("index", position)), {
                "id": None, "type": "function", "function": {"name": "", "arguments": ""}})
            if delta.get("id") and call["id"] is None:
                call["id"] = str(delta["id"])
            if delta.get("type"):
                call["type"] = str(delta["type"])
            function = delta.get("function") or {}
            if function.get("name") and not call["function"]["name"]:
                call["function"]["name"] = str(function["name"])
            call["function"]["arguments"] += str(function.get("arguments") or "")

    def tool_calls(self, index: int) -> list[dict[str, Any]] | None:
        """The choice's tool calls in a whole message's shape (``id``, ``type``,
        ``function``), by tool index; None if it made none."""
        calls = self._tool_calls.get(index)
        if not calls:
            return None
        return [calls[i] for i in sorted(calls)]

    @property
    def produced_anything(self) -> bool:
        return self._num_text_deltas > 0

    def text(self, index: int) -> str:
        return "".join(self._texts.get(index, ()))

    def logprobs(self, index: int) -> dict[str, Any] | None:
        """The choice's logprobs, the deltas' lists concatenated (None if none were sent)."""
        return self._logprobs.get(index)

    def completion_tokens(self) -> int:
        """Reported completion tokens, else recounted from the text received."""
        if self.usage is not None:
            return self.usage.completion_tokens
        if self._tokenizer is None:
            return self._num_text_deltas
        tokenizer = self._tokenizer
        total = sum(len(tokenizer.encode(self.text(i))) for i in self._texts)
        for calls in self._tool_calls.values():
            for call in calls.values():
                function = call["function"]
                total += len(tokenizer.encode(function["name"] + function["arguments"]))
        return total

    def choices(self) -> list[ChoiceResult]:
        """Every choice seen, by index, with its text and finish reason."""
        return [
            ChoiceResult(index=i, text=self.text(i), finish_reason=self._finish.get(i))
            for i in sorted(self._texts)
        ]

    def all_stopped(self) -> bool:
        """True if every choice ended with ``stop`` and none called a tool (complete
        text answers: cacheable)."""
        return (bool(self._texts) and not self._tool_calls
                and all(self._finish.get(i) == "stop" for i in self._texts))
