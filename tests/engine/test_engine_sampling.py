"""Sampling: seeded reproducibility, top-k / top-p support, stop strings and ids,
logprobs, n choices."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.api import FinishReason, GenerationRequest, SamplingParams
from engine.config import EngineConfig
from engine.factory import LoadedModel, build_llm_engine
from engine.output import OutputProcessor
from engine.sampling import (
    filter_logits,
    greedy_tokens,
    inverse_cdf,
    make_generator,
    sample_batch,
    sample_row,
)
from engine.sequence import Sequence
from engine.tokenizer import ByteTokenizer

PROMPT = tuple(b + 3 for b in b"Once upon a time")


def _texts(
    loaded: LoadedModel, params: SamplingParams, rid: str = "r"
) -> list[tuple[list[int], str, object]]:
    engine = build_llm_engine(EngineConfig.tiny(), loaded)
    out = engine.generate_sync([GenerationRequest(rid, PROMPT, params)])[rid]
    return [
        (
            [t for c in choice for t in c.token_ids],
            "".join(c.text for c in choice),
            choice[-1].finish_reason,
        )
        for choice in out
    ]


def test_greedy_tokens_match_argmax_with_ties_and_nan() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 49_152, generator=gen)
    logits[3, [10, 20_000]] = 50.0  # a tie: the first index wins
    logits[5, [7, 9]] = float("nan")  # NaN propagates: the first NaN
    logits[6] = 0.0  # all equal
    expected = torch.argmax(logits, dim=-1)
    assert torch.equal(greedy_tokens(logits), expected)
    assert greedy_tokens(logits)[[3, 5, 6]].tolist() == [10, 7, 0]
    for row in (logits[3], logits[5], logits[11]):
        assert int(greedy_tokens(row)) == int(torch.argmax(row))


def test_seed_makes_sampling_reproducible_and_choices_differ(tiny_model: LoadedModel) -> None:
    p = SamplingParams(max_tokens=16, temperature=1.5, seed=42, n=3, ignore_eos=True)
    first, second = _texts(tiny_model, p), _texts(tiny_model, p)
    assert first == second
    assert len({tuple(toks) for toks, _, _ in first}) > 1
    other = _texts(
        tiny_model, SamplingParams(max_tokens=16, temperature=1.5, seed=43, ignore_eos=True)
    )
    assert other[0][0] != first[0][0]


def test_top_k_and_top_p_keep_the_right_support() -> None:
    logits = torch.log(torch.tensor([0.05, 0.4, 0.3, 0.2, 0.05]))
    kept = torch.isfinite(filter_logits(logits, top_k=2, top_p=1.0))
    assert kept.tolist() == [False, True, True, False, False]
    kept = torch.isfinite(filter_logits(logits, top_k=0, top_p=0.75))  # 0.4 + 0.3 < 0.75 -> +0.2
    assert kept.tolist() == [False, True, True, True, False]
    kept = torch.isfinite(filter_logits(logits, top_k=0, top_p=0.1))
    assert kept.tolist() == [False, True, False, False, False]
    gen = make_generator(SamplingParams(temperature=1.0, seed=0, top_k=2), 0)
    draws = {sample_row(logits, SamplingParams(temperature=1.0, top_k=2), gen) for _ in range(200)}
    assert draws == {1, 2}


def _feed(text: str, params: SamplingParams) -> tuple[list[str], FinishReason | None]:
    """Push ``text`` byte by byte through the output processor, as sampled tokens."""
    tok = ByteTokenizer()
    proc = OutputProcessor(tok, max_model_len=1000)
    seq = Sequence(0, "s", 0, [1, 4], 2, params, None, 0)
    deltas: list[str] = []
    for t in tok.encode(text):
        seq.token_ids.append(t)
        chunk = proc.process(seq, 2)
        if chunk is not None:
            deltas.append(chunk.text)
        if seq.finish_reason is not None:
            break
    return deltas, seq.finish_reason


def test_stop_string_cuts_text_and_is_never_streamed() -> None:
    deltas, reason = _feed(
        "Hello, woréld! END of it", SamplingParams(max_tokens=100, stop=("END", "ld!!"))
    )
    assert reason is FinishReason.STOP
    assert "".join(deltas) == "Hello, woréld! "
    assert all("�" not in d and "E" not in d for d in deltas)  # partial UTF-8 / stop held back
    deltas, reason = _feed("no stop here", SamplingParams(max_tokens=100, stop=("zz",)))
    assert reason is None and "".join(deltas) == "no stop here"
    deltas, reason = _feed("abcdef", SamplingParams(max_tokens=4, stop=("cdx",)))
    assert reason is FinishReason.LENGTH and "".join(deltas) == "abcd"


def test_invalid_bytes_stream_and_only_a_possible_partial_character_waits() -> None:
    """Replacement characters more than 3 from the end can never become text: they
    stream; the last 3 wait, since an incomplete character may still be completed."""
    tok = ByteTokenizer()
    proc = OutputProcessor(tok, max_model_len=1000)
    seq = Sequence(0, "s", 0, [1, 4], 2, SamplingParams(max_tokens=100), None, 0)
    sent = ""
    for byte in b"\xff" * 8 + "\u20ac".encode()[:2]:  # garbage, then 2 of the euro's 3 bytes
        seq.token_ids.append(byte + ByteTokenizer.NUM_SPECIAL)
        chunk = proc.process(seq, 2)
        sent += chunk.text if chunk is not None else ""
    assert sent == "\ufffd" * 6  # of 9 replacement characters, the last 3 wait
    seq.token_ids.append("\u20ac".encode()[2] + ByteTokenizer.NUM_SPECIAL)
    chunk = proc.process(seq, 2)
    assert chunk is not None and sent + chunk.text == "\ufffd" * 8 + "\u20ac"


def test_stop_token_id_finishes_without_its_text(tiny_model: LoadedModel) -> None:
    ((toks, _, _),) = _texts(
        tiny_model, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    )
    stop_id = toks[3]
    first = toks.index(stop_id)
    ((got, got_text, reason),) = _texts(
        tiny_model, SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(stop_id,))
    )
    assert reason is FinishReason.STOP
    assert got == toks[: first + 1]
    assert got_text == bytes(t - 3 for t in toks[:first]).decode("utf-8", "replace")


def test_logprobs_are_reported_per_token(tiny_model: LoadedModel) -> None:
    engine = build_llm_engine(EngineConfig.tiny(), tiny_model)
    p = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True)
    out = engine.generate_sync([GenerationRequest("lp", PROMPT, p)])["lp"][0]
    lps = [lp for c in out for lp in c.logprobs]
    toks = [t for c in out for t in c.token_ids]
    assert [lp.token_id for lp in lps] == toks
    for lp in lps:
        assert len(lp.top) == 3
        assert lp.top[0][0] == lp.token_id  # greedy picks the most likely token
        assert lp.logprob <= 0


def test_a_tiny_temperature_is_greedy_and_cannot_fail_other_requests(
    tiny_model: LoadedModel,
) -> None:
    """logits / 1e-40 overflows to inf; the step must not fail every request in it."""
    engine = build_llm_engine(EngineConfig.tiny(), tiny_model)
    tiny = SamplingParams(max_tokens=6, temperature=1e-40, seed=1, ignore_eos=True)
    other = SamplingParams(max_tokens=6, temperature=0.7, seed=2, ignore_eos=True)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    out = engine.generate_sync([
        GenerationRequest("tiny", PROMPT, tiny),
        GenerationRequest("other", PROMPT, other),
        GenerationRequest("greedy", PROMPT, greedy),
    ])
    tokens = {rid: [t for c in out[rid][0] for t in c.token_ids] for rid in out}
    assert len(tokens["other"]) == 6
    assert tokens["tiny"] == tokens["greedy"] and len(tokens["tiny"]) == 6


def test_inverse_cdf_picks_by_cumulative_mass_and_never_a_zero() -> None:
    probs = torch.tensor([[0.0, 0.1, 0.0, 0.6, 0.3, 0.0]]).repeat(6, 1)
    u = torch.tensor([0.0, 0.0999, 0.1001, 0.69, 0.71, 1.0 - 2**-24])
    assert inverse_cdf(probs, u).tolist() == [1, 1, 3, 3, 4, 4]
    unnormalised = torch.tensor([[2.0, 0.0, 6.0]])  # total 8: u = 0.5 -> mass 4 -> token 2
    assert inverse_cdf(unnormalised, torch.tensor([0.5])).tolist() == [2]


@settings(max_examples=200, deadline=None)
@given(
    weights=st.lists(st.sampled_from([0.0, 1e-30, 1e-6, 0.5, 1.0, 3.0]), min_size=1, max_size=40)
    .filter(lambda w: sum(w) > 0),
    u=st.floats(min_value=0.0, max_value=1.0 - 2**-24),
)
def test_inverse_cdf_only_picks_tokens_of_positive_probability(
    weights: list[float], u: float
) -> None:
    probs = torch.tensor([weights], dtype=torch.float32)
    (token,) = inverse_cdf(probs, torch.tensor([u])).tolist()
    assert probs[0, token] > 0


def test_sampled_frequencies_follow_the_distribution() -> None:
    logits = torch.log(torch.tensor([0.1, 0.0, 0.6, 0.3]))
    params = SamplingParams(temperature=1.0, seed=0)
    gen = make_generator(params, 0)
    draws = [sample_row(logits, params, gen) for _ in range(4000)]
    counts = [draws.count(t) / len(draws) for t in range(4)]
    assert counts[1] == 0.0
    for got, want in zip(counts, (0.1, 0.0, 0.6, 0.3), strict=True):
        assert abs(got - want) < 0.03  # 4 sigma at p = 0.6, n = 4000: 0.031


def test_a_batch_draws_each_row_from_its_own_generator() -> None:
    """Row i's draw depends only on row i's generator: batching changes nothing."""
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.8, seed=s, top_k=50 if s == 2 else 0) for s in range(5)]
    together, _ = sample_batch(logits, params, [make_generator(p, 0) for p in params])
    alone = [sample_row(logits[i], p, make_generator(p, 0)) for i, p in enumerate(params)]
    assert together == alone


def test_a_nan_row_still_yields_a_token_id_in_range() -> None:
    probs = torch.tensor([[0.2, float("nan"), 0.3], [0.5, 0.5, 0.0]])
    tokens = inverse_cdf(probs, torch.tensor([0.9, 0.9])).tolist()
    assert 0 <= tokens[0] < 3 and tokens[1] == 1
