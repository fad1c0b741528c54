"""core.admission: the policy's validation, the rejection formula, the window, the draws."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from askonce.core.admission import Admission, AdmissionPolicy


@pytest.mark.parametrize("kwargs", [
    {"window": 0}, {"window": 3601}, {"window": 1.5}, {"window": True},
    {"min_success": 0}, {"min_success": 1.01}, {"min_success": math.nan}, {"min_success": True},
    {"max_reject": -0.1}, {"max_reject": 1}, {"max_reject": math.nan},
    {"min_requests": 0}, {"min_requests": 2.0}, {"count_rejected": 1},
])
def test_a_bad_policy_is_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        AdmissionPolicy(**kwargs)  # type: ignore[arg-type]


def test_the_defaults_shed_only_below_five_percent_success() -> None:
    p = AdmissionPolicy()
    assert (p.window, p.min_success, p.max_reject, p.min_requests, p.count_rejected) == (
        10, 0.05, 0.99, 20, False)


DEFAULT = AdmissionPolicy()


def _fed(calls: int, successes: int, policy: AdmissionPolicy = DEFAULT,
         extra_requests: int = 0) -> Admission:
    """An admission whose window holds ``calls`` judged attempts, ``successes`` of them good."""
    a = Admission(policy)
    for i in range(calls + extra_requests):
        assert a.admit(0.0, 0.999999) or policy.max_reject > 0.999999
        if i < calls:
            a.record(0.0, success=i < successes)
    return a


@pytest.mark.parametrize(("calls", "successes", "expected"), [
    (100, 100, 0.0),
    (100, 50, 0.0),  # 50 % errors: nothing shed (no retries would send them all)
    (100, 10, 0.0),  # 90 % errors: nothing shed
    (100, 5, 0.0),  # exactly at min_success: (100 - 100) / 101
    (100, 4, (100 - 80) / 101),
    (100, 1, (100 - 20) / 101),
    (100, 0, 0.99),  # 100 / 101 capped at max_reject
    (20, 0, 0.95238095),  # 20 / 21: enough requests, under the cap
    (19, 0, 0.0),  # fewer requests than min_requests: no verdict
    (1000, 0, 0.99),
])
def test_the_rejection_probability(calls: int, successes: int, expected: float) -> None:
    assert _fed(calls, successes).reject_probability(0.5) == pytest.approx(expected)


def test_the_request_minimum_counts_requests_not_calls() -> None:
    # 5 judged failures among 25 requests: enough requests, so the 5 failures are a verdict.
    a = _fed(5, 0, extra_requests=20)
    assert a.requests == 25 and a.calls == 5
    assert a.reject_probability(0.0) == pytest.approx(5 / 6)


def test_the_sre_formula_counts_refused_requests_too() -> None:
    sre = AdmissionPolicy(min_success=0.5, count_rejected=True, max_reject=0.9)
    envoy = AdmissionPolicy(min_success=0.5, max_reject=0.9)
    # 40 requests, 20 judged, 10 good: Envoy's way (20 - 20) / 21 = 0; the SRE's (40 - 20) / 41.
    assert _fed(20, 10, envoy, extra_requests=20).reject_probability(0.0) == 0.0
    assert _fed(20, 10, sre, extra_requests=20).reject_probability(0.0) == pytest.approx(20 / 41)


@pytest.mark.parametrize(("u", "admitted"), [(0.0, False), (0.989, False), (0.99, True),
                                             (0.999, True)])
def test_a_draw_below_p_is_refused(u: float, admitted: bool) -> None:
    a = _fed(100, 0)  # p = 0.99
    assert a.admit(0.0, u) is admitted


@pytest.mark.parametrize("u", [-0.1, 1.0, math.nan])
def test_a_draw_outside_the_unit_interval_is_a_bug(u: float) -> None:
    with pytest.raises(ValueError):
        Admission().admit(0.0, u)


@pytest.mark.parametrize("now", [math.inf, -math.inf, math.nan])
def test_a_non_finite_time_is_a_bug(now: float) -> None:
    a = Admission()
    with pytest.raises(ValueError):
        a.admit(now, 0.5)
    with pytest.raises(ValueError):
        a.record(now, success=True)


@pytest.mark.parametrize(("later", "left"), [(9.999, 100), (10.0, 0), (15.0, 0), (1e6, 0)])
def test_the_window_forgets_whole_seconds(later: float, left: int) -> None:
    a = _fed(100, 0)  # all at t = 0, in the bucket of second 0
    assert a.reject_probability(later) == (0.99 if left else 0.0)
    assert a.calls == left and a.requests == left


def test_a_time_earlier_than_one_seen_is_the_latest_seen() -> None:
    a = _fed(100, 0)
    a.reject_probability(12.0)  # second 0 has aged out
    a.record(3.0, success=False)  # counted at 12.0, not in a bucket of the past
    assert a.calls == 1
    assert a.reject_probability(21.9) == 0.0 and a.calls == 1  # still in the window (13..22]
    assert a.reject_probability(22.0) == 0.0 and a.calls == 0


def test_recovery_is_seen_within_a_few_successes() -> None:
    a = _fed(100, 0)
    assert a.reject_probability(1.0) == 0.99
    for _ in range(5):  # each success outweighs 1 / min_success = 20 failures (and itself)
        a.record(1.0, success=True)
    assert a.reject_probability(1.0) == pytest.approx(5 / 106)
    a.record(1.0, success=True)  # 6 of 106: above 5 %
    assert a.reject_probability(1.0) == 0.0


events = st.lists(st.tuples(st.floats(0, 100, allow_nan=False),
                            st.sampled_from(["ask", "ok", "bad"]),
                            st.floats(0, 1, exclude_max=True)), max_size=200)


@given(events, st.integers(1, 20))
def test_the_totals_are_those_of_the_last_window_seconds(evs: list[tuple[float, str, float]],
                                                         window: int) -> None:
    a = Admission(AdmissionPolicy(window=window, min_requests=1))
    seen: list[tuple[int, str]] = []
    latest = -math.inf
    for now, kind, u in evs:  # in any order: a time seen earlier is the latest
        latest = max(latest, now)
        if kind == "ask":
            a.admit(now, u)
        else:
            a.record(now, success=kind == "ok")
        seen.append((math.floor(latest), kind))
    if not seen:
        return
    head = seen[-1][0]
    inside = [k for sec, k in seen if head - window < sec <= head]
    assert a.requests == inside.count("ask")
    assert a.calls == inside.count("ok") + inside.count("bad")
    assert a.successes == inside.count("ok")


@given(st.integers(0, 500), st.integers(0, 500), st.floats(0.01, 1), st.floats(0, 0.999))
def test_p_is_bounded_and_zero_at_or_above_min_success(calls: int, good: int, min_success: float,
                                                       cap: float) -> None:
    good = min(good, calls)
    policy = AdmissionPolicy(min_success=min_success, max_reject=cap, min_requests=1)
    p = _fed(calls, good, policy).reject_probability(0.0)
    assert 0.0 <= p <= cap
    if calls and good / calls >= min_success:
        assert p == 0.0


@pytest.mark.parametrize(("success", "least", "most"), [
    (1.0, 1.0, 1.0), (0.5, 1.0, 1.0), (0.1, 0.99, 1.0),  # above min_success: every attempt goes
    (0.025, 0.3, 0.7),  # half of min_success: about half shed
    (0.0, 0.005, 0.03),  # a dead target: the trickle (max_reject 0.99, and the +1)
])
def test_admission_is_proportional_under_independent_failures(success: float, least: float,
                                                              most: float) -> None:
    """1000 attempts a second for 60 s against a target that answers ``success`` of them."""
    rng = random.Random(7)
    a = Admission()
    asked = admitted = 0
    for i in range(60_000):
        now = i / 1000
        asked += 1
        if a.admit(now, rng.random()):
            admitted += 1
            a.record(now, success=rng.random() < success)
    assert least <= admitted / asked <= most


def test_the_sre_formula_collapses_where_no_retries_would_answer() -> None:
    """K = 2 over all requests: at 30 % success the admitted share decays to a trickle."""
    rng = random.Random(7)
    a = Admission(AdmissionPolicy(min_success=0.5, count_rejected=True, max_reject=0.999))
    admitted = 0
    for i in range(60_000):
        now = i / 1000
        if a.admit(now, rng.random()):
            admitted += 1
            a.record(now, success=rng.random() < 0.3)
    assert admitted / 60_000 < 0.1
