"""bench.economics_accounting on tiny synthetic inputs: the perfect-cache computation,
wrong semantic hits, the join with ledger rows and the summary's money."""

from __future__ import annotations

import uuid

from hypothesis import given
from hypothesis import strategies as st

from bench.economics_accounting import (
    LedgerRow,
    SentRequest,
    join,
    perfect_caches,
    report,
    summarize,
    wrong_semantic_hits,
)
from billing.rating import PriceQuote

# pico per token: input 10, cached 4, output 20; a semantic hit bills 10% of list
PRICE = PriceQuote(input_pico=10, cached_input_pico=4, output_pico=20, semantic_hit_ppm=100_000)


def sent(tenant: str, prompt: list[int], cls: str, cache: str = "miss",
         finish: str | None = "stop", answer: str = "", rid: str | None = None) -> SentRequest:
    return SentRequest(rid or str(uuid.uuid4()), tenant, tuple(prompt), cls, cache, finish,
                       answer or f"answer to {cls}")


def row(s: SentRequest, served_by: str, prompt: int, cached: int, completion: int,
        billed: int) -> LedgerRow:
    listed = prompt * 10 + completion * 20
    return LedgerRow(uuid.UUID(s.request_id).hex, s.tenant, served_by, prompt, cached,
                     completion, billed, listed)


def test_prefix_ideal_is_the_longest_earlier_prefix_of_the_same_tenant_in_whole_blocks() -> None:
    base = list(range(100, 140))  # 40 tokens
    reqs = [
        sent("P", base, "a"),
        sent("P", [*base[:35], 1, 2, 3], "b"),  # shares 35 tokens with the first
        sent("Q", base, "c"),  # another tenant: shares nothing with P's prompts
        sent("P", base + [7] * 10, "d"),  # extends the first: 40 tokens
        sent("P", [9] * 20, "e"),
    ]
    ideals = perfect_caches(reqs, block_size=16)
    assert [(i.cached_tokens, i.cached_tokens_token_level) for i in ideals] == [
        (0, 0), (32, 35), (0, 0), (32, 40), (0, 0)]
    assert not any(i.semantic or i.repeat for i in ideals)


def test_semantic_ideal_needs_an_earlier_complete_answer_to_the_same_question() -> None:
    reqs = [
        sent("Q", [1, 2], "x", finish="length"),  # cut: not cacheable
        sent("Q", [1, 3], "x"),  # its paraphrase: nothing complete yet, then complete
        sent("Q", [1, 4], "x"),  # now a perfect semantic hit
        sent("P", [1, 4], "x"),  # another tenant's history does not count
        sent("Q", [1, 5], "y"),  # a different question
    ]
    assert [i.semantic for i in perfect_caches(reqs, 16)] == [False, False, True, False, False]


def test_a_repeat_is_an_exact_prompt_whose_earlier_answer_was_complete() -> None:
    reqs = [
        sent("Q", [1, 2], "x", finish="length"),  # cut: no exact entry
        sent("Q", [1, 3], "x"),  # a paraphrase completes: the class is cacheable
        sent("Q", [1, 2], "x"),  # the first prompt again: served by the paraphrase's entry
        sent("Q", [1, 3], "x"),  # an exact repeat of a complete answer
    ]
    ideals = perfect_caches(reqs, 16)
    assert [(i.semantic, i.repeat) for i in ideals] == [
        (False, False), (False, False), (True, False), (True, True)]


def test_a_hit_is_wrong_when_its_answer_came_from_another_question() -> None:
    reqs = [
        sent("Q", [1], "x", answer="Paris."),
        sent("Q", [2], "y", answer="Ten."),
        sent("Q", [3], "x", cache="semantic", answer="Paris."),  # right
        sent("Q", [4], "z", cache="semantic", answer="Ten."),  # wrong: z is not y
        sent("Q", [5], "x", cache="miss", answer="Ten."),  # not a hit: never wrong
        sent("P", [6], "y", cache="semantic", answer="Ten."),  # other tenant's answer
    ]
    assert wrong_semantic_hits(reqs) == [False, False, False, True, False, True]


def test_join_rates_the_ledger_rows_token_counts_at_the_ideal() -> None:
    first = sent("Q", list(range(40)), "x")
    para = sent("Q", list(range(20)) + [99] * 10, "x", cache="miss")  # paraphrase, missed
    rep = sent("Q", list(range(40)), "x", cache="semantic", answer=first.answer)
    lost = sent("Q", [5] * 8, "z")  # no ledger row
    rows = [
        row(first, "engine", 40, 0, 5, 40 * 10 + 5 * 20),
        row(para, "engine", 30, 16, 6, 14 * 10 + 16 * 4 + 6 * 20),
        row(rep, "semantic", 40, 0, 5, (40 * 10 + 5 * 20) // 10),
    ]
    joined, missing = join([first, para, rep, lost], rows, 16, PRICE)
    assert missing == [lost.request_id]
    assert [j.perfect_billed_pico for j in joined] == [
        500,  # nothing earlier: the list price
        (30 * 10 + 6 * 20) // 10,  # a semantic hit (42) bills less than 16 cached (324)
        50,  # the repeat, served as perfect caches would
    ]
    assert [j.perfect_billed_token_level_pico for j in joined] == [500, 42, 50]
    out = summarize(joined)
    assert out["list_pico"] == 500 + 420 + 500
    assert out["billed_pico"] == 500 + 324 + 50
    assert out["perfect_billed_pico"] == 500 + 42 + 50
    assert out["savings_fraction_of_perfect"] == round((1420 - 874) / (1420 - 592), 4)
    assert out["semantic_hits"] == 1
    assert (out["semantic_cacheable"], out["semantic_cacheable_served"]) == (2, 1)
    assert (out["semantic_cacheable_repeats"], out["semantic_cacheable_repeats_served"]) == (1, 1)
    assert out["wrong_semantic_hits"] == 0
    assert out["wrong_semantic_hit_share"] == 0.0
    assert out["missing_savings_pico"] == {
        "semantic_missed": 324 - 42, "prefix_shortfall": 0, "semantic_hits_served": 0}


def test_a_wrong_hit_saves_more_than_perfect_and_is_counted() -> None:
    a = sent("Q", [1] * 20, "x", answer="Yes.")
    b = sent("Q", [2] * 20, "y", cache="semantic", answer="Yes.")  # not a duplicate of x
    rows = [row(a, "engine", 20, 0, 2, 240), row(b, "semantic", 20, 0, 2, 24)]
    joined, _ = join([a, b], rows, 16, PRICE)
    out = report(joined)["tenants"]["Q"]
    assert out["wrong_semantic_hits"] == 1
    assert out["wrong_semantic_hit_share"] == 1.0
    assert out["missing_savings_pico"]["semantic_hits_served"] == 24 - 240
    assert out["savings_fraction_of_perfect"] is None  # perfect caches save nothing here


prompts = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=40), min_size=1,
                   max_size=12)


@given(prompts, st.integers(1, 17))
def test_ideal_is_whole_blocks_below_the_token_level_prefix(
    token_lists: list[list[int]], block_size: int
) -> None:
    reqs = [sent("P", p, str(i)) for i, p in enumerate(token_lists)]
    for r, ideal in zip(reqs, perfect_caches(reqs, block_size), strict=True):
        assert ideal.cached_tokens % block_size == 0
        assert ideal.cached_tokens <= ideal.cached_tokens_token_level <= len(r.prompt_ids)
        assert ideal.cached_tokens_token_level - ideal.cached_tokens < block_size


@given(prompts, st.data())
def test_missing_savings_by_layer_add_up_to_perfect_minus_actual(
    token_lists: list[list[int]], data: st.DataObject
) -> None:
    reqs, rows = [], []
    ideals = perfect_caches([sent("Q", p, "c") for p in token_lists], 4)
    for p, ideal in zip(token_lists, ideals, strict=True):
        semantic = data.draw(st.booleans())
        s = sent("Q", p, "c", cache="semantic" if semantic else "miss")
        cached = 0 if semantic else data.draw(st.integers(0, ideal.cached_tokens))
        completion = data.draw(st.integers(0, 9))
        listed = len(p) * 10 + completion * 20
        billed = listed // 10 if semantic else (len(p) - cached) * 10 + cached * 4 + completion * 20
        reqs.append(s)
        rows.append(row(s, "semantic" if semantic else "engine", len(p), cached, completion,
                        billed))
    joined, missing = join(reqs, rows, 4, PRICE)
    assert not missing
    out = summarize(joined)
    assert sum(out["missing_savings_pico"].values()) == (
        out["perfect_savings_pico"] - out["savings_pico"])
    assert out["perfect_billed_pico"] <= out["list_pico"]

