"""The conversions between the gateway's flow and the semantic cache: a hit replayed as
upstream items folds back into the same answer, which is what the cache is offered."""

from __future__ import annotations

import asyncio

from proxy.semantic.types import SemanticAnswer, SemanticChoice, SemanticHit
from proxy.semantic_exchange import cache_answer, replay_hit
from proxy.tally import Tally
from proxy.upstream.base import UpstreamDelta, UpstreamUsage


async def _items(hit: SemanticHit, prompt_tokens: int) -> list[object]:
    return [item async for item in replay_hit(hit, prompt_tokens)]


def test_a_hit_replays_as_one_delta_per_choice_then_a_fully_cached_usage() -> None:
    hit = SemanticHit((SemanticChoice("Paris.", "stop"), SemanticChoice("Lyon", "length")),
                      similarity=0.97, completion_tokens=5)  # fmt: skip
    items = asyncio.run(_items(hit, prompt_tokens=12))
    assert items == [
        UpstreamDelta(index=0, text="Paris.", finish_reason="stop"),
        UpstreamDelta(index=1, text="Lyon", finish_reason="length"),
        UpstreamUsage(prompt_tokens=12, completion_tokens=5, cached_tokens=12),
    ]
    tally = Tally()
    for item in items:
        assert isinstance(item, UpstreamDelta | UpstreamUsage)
        tally.add(item)
    assert cache_answer(tally, prompt_tokens=99) == SemanticAnswer(
        choices=hit.choices, completion_tokens=5, prompt_tokens=12
    )


def test_an_answer_without_usage_keeps_the_admitted_prompt_count() -> None:
    tally = Tally()
    tally.add(UpstreamDelta(index=0, text="Hello", finish_reason=None))
    tally.add(UpstreamDelta(index=0, text=" there", finish_reason="stop"))
    answer = cache_answer(tally, prompt_tokens=7)
    assert answer.prompt_tokens == 7 and answer.completion_tokens == 2
    assert answer.choices == (SemanticChoice("Hello there", "stop"),)
