"""The error bound's serving rule (proxy.semantic.bound)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.semantic.bound import (
    NUM_BINS,
    BoundConfig,
    ErrorBound,
    Evidence,
    score_bin,
    wilson_interval,
)

scores = st.floats(min_value=0.0, max_value=0.999, allow_nan=False)
deltas = st.floats(min_value=0.001, max_value=0.5, allow_nan=False)
observations = st.lists(st.tuples(scores, st.booleans()), max_size=60)


def evidence(obs: list[tuple[float, bool]]) -> Evidence:
    return Evidence.of(obs)


@settings(max_examples=300, deadline=None)
@given(obs=observations, entry_obs=observations, new=scores, s=scores)
def test_correct_evidence_never_raises_the_bound(obs, entry_obs, new, s) -> None:
    bound = ErrorBound()
    tenant, entry = evidence(obs), evidence(entry_obs)
    mu = bound.tenant_upper(tenant, s)
    assert bound.tenant_upper(tenant.add(new, True), s) <= mu + 1e-12
    post = bound.entry_error(entry, mu, s)
    assert bound.entry_error(entry.add(new, True), mu, s) <= post + 1e-12


@settings(max_examples=300, deadline=None)
@given(obs=observations, entry_obs=observations, new=scores, s=scores)
def test_wrong_evidence_never_lowers_the_bound(obs, entry_obs, new, s) -> None:
    bound = ErrorBound()
    tenant, entry = evidence(obs), evidence(entry_obs)
    mu = bound.tenant_upper(tenant, s)
    assert bound.tenant_upper(tenant.add(new, False), s) >= mu - 1e-12
    post = bound.entry_error(entry, mu, s)
    assert bound.entry_error(entry.add(new, False), mu, s) >= post - 1e-12


@settings(max_examples=300, deadline=None)
@given(obs=observations, entry_obs=observations, low=scores, high=scores, delta=deltas)
def test_a_higher_score_is_never_less_servable(obs, entry_obs, low, high, delta) -> None:
    low, high = min(low, high), max(low, high)
    bound, tenant, entry = ErrorBound(), evidence(obs), evidence(entry_obs)
    at_low, at_high = (
        bound.decide(low, delta, entry, tenant),
        bound.decide(high, delta, entry, tenant),
    )
    assert at_high.entry_error <= at_low.entry_error + 1e-12
    assert at_high.serve or not at_low.serve


@settings(max_examples=300, deadline=None)
@given(s=scores, delta=st.floats(min_value=0.001, max_value=0.3), wrong_only=observations)
def test_never_serves_without_positive_evidence(s, delta, wrong_only) -> None:
    """With no correct observation (prior only, or only wrong ones) no non-exact hit."""
    tenant = evidence([(score, False) for score, _ in wrong_only])
    entry = evidence([(score, False) for score, _ in wrong_only[:3]])
    assert not ErrorBound().decide(s, delta, entry, tenant).serve


@given(delta=deltas)
def test_exact_repeats_are_served(delta) -> None:
    assert ErrorBound().decide(1.0, delta, Evidence(), Evidence()).serve


def test_tenant_evidence_opens_new_entries_and_a_wrong_entry_stays_shut() -> None:
    bound = ErrorBound()
    tenant = evidence([(0.9, True)] * 400)
    assert bound.decide(0.9, 0.02, Evidence(), tenant).serve  # a new entry
    assert not bound.decide(0.6, 0.02, Evidence(), tenant).serve  # no evidence down there
    bad = evidence([(0.95, False)])
    assert not bound.decide(0.9, 0.02, bad, tenant.plus(bad)).serve


def test_an_entry_seen_right_often_is_served_below_the_tenants_reach() -> None:
    bound = ErrorBound()
    tenant = evidence([(0.8, True)] * 150 + [(0.8, False)] * 3)
    assert not bound.decide(0.8, 0.02, Evidence(), tenant).serve
    popular = evidence([(0.75, True)] * 40)
    assert bound.decide(0.8, 0.02, popular, tenant.plus(popular)).serve


@settings(max_examples=200, deadline=None)
@given(wrong=st.integers(0, 50), extra=st.integers(0, 200), z=st.floats(0.5, 3.0))
def test_wilson_contains_the_rate(wrong, extra, z) -> None:
    total = wrong + extra
    low, high = wilson_interval(wrong, total, z)
    if total:
        assert low - 1e-12 <= wrong / total <= high + 1e-12
    assert 0.0 <= low <= high <= 1.0


def test_bins_and_bad_input() -> None:
    assert score_bin(0.0) == 0 and score_bin(1.0) == NUM_BINS - 1 and score_bin(0.951) == 19
    with pytest.raises(ValueError):
        ErrorBound().decide(0.9, 0.0, Evidence(), Evidence())
    with pytest.raises(ValueError):
        ErrorBound().decide(0.9, 1.0, Evidence(), Evidence())
    with pytest.raises(ValueError):
        Evidence((0,) * 3, (0,) * 3)
    with pytest.raises(ValueError):
        BoundConfig(kappa=0)
