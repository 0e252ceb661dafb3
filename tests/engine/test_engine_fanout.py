"""Fan-out of a request into its choices: numbering, held choices, release and drop."""

from __future__ import annotations

from engine.api import GenerationRequest, SamplingParams
from engine.fanout import FanOut


def _req(rid: str, n: int, seed: int | None = None) -> GenerationRequest:
    return GenerationRequest(rid, (5, 6, 7), SamplingParams(max_tokens=2, n=n, seed=seed))


def test_choices_share_the_prompt_and_all_but_the_first_are_held() -> None:
    fan = FanOut()
    (alone,) = fan.split(_req("a", 1))
    choices = fan.split(_req("b", 3, seed=7))
    assert [c.seq_id for c in choices] == [1, 2, 3] and alone.seq_id == 0
    assert [c.index for c in choices] == [0, 1, 2]
    assert {c.arrival for c in choices} == {1} and alone.arrival == 0
    assert all(c.token_ids == [5, 6, 7] and c.num_prompt_tokens == 3 for c in choices)
    assert len({id(c.token_ids) for c in choices}) == 3  # each choice grows its own list
    assert fan.num_held() == 2
    assert fan.release(alone) == []
    assert fan.release(choices[0]) == choices[1:]
    assert fan.release(choices[0]) == [] and fan.num_held() == 0


def test_seeded_choices_draw_from_their_own_generators() -> None:
    choices = FanOut().split(_req("s", 2, seed=11))
    g0, g1 = (c.generator for c in choices)
    assert g0 is not None and g1 is not None
    assert g0.initial_seed() == 11 and g1.initial_seed() == 12


def test_dropping_held_choices_forgets_the_request() -> None:
    fan = FanOut()
    first, second, third = fan.split(_req("r", 3))
    assert not fan.drop(first)  # choice 0 is never held
    assert fan.drop(second) and fan.num_held() == 1
    assert fan.drop(third) and fan.num_held() == 0
    assert fan.release(first) == []
    assert len(fan.split(_req("r", 2))) == 2  # the id can be used again
