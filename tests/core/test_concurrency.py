"""The adaptive concurrency limit (core.concurrency): a fake clock, latencies chosen by the test."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from askonce.core.concurrency import OVER, TAKEN, TOO_LATE, ConcurrencyPolicy, Limiter

POLICY = ConcurrencyPolicy(initial_limit=20, min_limit=4, max_limit=100, interval=0.1,
                           min_samples=5)


def serve(limiter: Limiter, now: float, seconds: float, latency: float, *, rate: float = 100.0,
          busy: int = 0, ok: bool = True) -> float:
    """Requests at ``rate``/s for ``seconds``, each taking ``latency``, with ``busy`` more held in
    flight meanwhile (the load that makes the limit matter). Returns the clock at the end."""
    held = [limiter.try_acquire(now) for _ in range(busy)]
    for _ in range(round(seconds * rate)):
        now += 1 / rate
        if limiter.try_acquire(now):
            limiter.release(now, latency, ok)
    for taken in held:
        if taken:
            limiter.release(now, latency, ok)
    return now


def test_the_limit_grows_while_latency_stays_at_the_floor() -> None:
    limiter = Limiter(POLICY)
    now = serve(limiter, 0.0, 1.0, 0.01, busy=15)
    assert limiter.baseline == pytest.approx(0.01)
    assert limiter.limit > 20
    grown = limiter.limit
    serve(limiter, now, 1.0, 0.01, busy=grown - 1)
    assert limiter.limit > grown


def test_an_idle_server_does_not_grow_its_limit() -> None:
    # One request in flight at a time says nothing about what 40 would do.
    limiter = Limiter(POLICY)
    serve(limiter, 0.0, 5.0, 0.01)
    assert limiter.limit == 20


def test_the_limit_shrinks_when_latency_rises() -> None:
    limiter = Limiter(POLICY)
    now = serve(limiter, 0.0, 1.0, 0.01, busy=15)
    before = limiter.limit
    serve(limiter, now, 0.5, 0.05, busy=min(before - 1, 15))  # five times the floor: queueing
    assert limiter.limit < before / 2


def test_latency_within_the_tolerance_does_not_shrink_it() -> None:
    limiter = Limiter(POLICY)
    now = serve(limiter, 0.0, 1.0, 0.010, busy=15)
    before = limiter.limit
    serve(limiter, now, 1.0, 0.014, busy=15)  # 1.4 x the floor, tolerance 1.5
    assert limiter.limit >= before


def test_a_slow_tail_is_not_taken_for_queueing() -> None:
    # Every tenth request takes 100 times as long: the fastest of each window is still the floor.
    limiter = Limiter(POLICY)
    now = 0.0
    for i in range(300):
        now += 0.01
        assert limiter.try_acquire(now)
        limiter.release(now, 1.0 if i % 10 == 0 else 0.01)
    assert limiter.baseline == pytest.approx(0.01)
    assert limiter.limit == 20  # nothing in flight beyond one: neither grown nor cut


def test_the_baseline_follows_a_slower_service_and_the_limit_comes_back() -> None:
    # Five times slower: taken for queueing at first (the limit near 2 x headroom), then, as the
    # baseline rises with its 10 s time constant, for what the service now is.
    limiter = Limiter(ConcurrencyPolicy(initial_limit=20))
    now = serve(limiter, 0.0, 1.0, 0.1, busy=15)
    before = limiter.limit
    now = serve(limiter, now, 1.0, 0.5, busy=2)
    cut = limiter.limit
    assert cut < before / 2 and cut <= 2 * limiter.policy.headroom + 1
    serve(limiter, now, 60.0, 0.5, busy=cut - 1)
    assert limiter.baseline is not None and limiter.baseline > 0.4
    assert limiter.limit > cut


@pytest.mark.parametrize("latency", [0.001, 10.0])
def test_never_below_min_nor_above_max(latency: float) -> None:
    # headroom 1: left alone, a long latency would take the limit to 2 (1 / (1 - 0.5)).
    policy = ConcurrencyPolicy(initial_limit=10, min_limit=5, max_limit=12, headroom=1.0,
                               baseline_window=1000.0)
    limiter = Limiter(policy)
    now = serve(limiter, 0.0, 1.0, 0.001, busy=9)
    serve(limiter, now, 10.0, latency, busy=9 if latency < 0.01 else 2)
    assert 5 <= limiter.limit <= 12
    assert limiter.limit == (12 if latency < 0.01 else 5)


def test_over_the_limit_is_refused_and_a_release_frees_a_slot() -> None:
    limiter = Limiter(ConcurrencyPolicy(initial_limit=3, min_limit=1))
    assert [limiter.try_acquire(0.0) for _ in range(4)] == [True, True, True, False]
    limiter.release(0.1, 0.1)
    assert limiter.inflight == 2
    assert limiter.try_acquire(0.1)


def test_a_quick_failure_is_no_sample_a_slow_one_is() -> None:
    limiter = Limiter(POLICY)
    now = serve(limiter, 0.0, 1.0, 0.01, busy=15)
    before = limiter.limit
    now = serve(limiter, now, 1.0, 0.0001, busy=15, ok=False)  # failed at once: no evidence
    assert limiter.baseline == pytest.approx(0.01)
    serve(limiter, now, 0.5, 0.2, busy=15, ok=False)  # cut at a deadline: queueing
    assert limiter.limit < before


@pytest.mark.parametrize("latency", [math.nan, -1.0, math.inf])
def test_a_latency_that_cannot_be_measured_frees_the_slot_without_a_sample(latency: float) -> None:
    limiter = Limiter(POLICY)
    assert limiter.try_acquire(0.0)
    limiter.release(1.0, latency)
    assert limiter.inflight == 0 and limiter.baseline is None


def test_a_request_whose_deadline_comes_before_the_fastest_recent_answer_is_too_late() -> None:
    limiter = Limiter(POLICY)
    assert not limiter.too_late(0.0, 0.001)  # nothing measured yet: nothing is too late
    now = serve(limiter, 0.0, 1.0, 0.5)  # every request takes half a second
    assert limiter.recent == 0.5
    assert limiter.too_late(now, now + 0.4) and not limiter.too_late(now, now + 0.6)
    # At the door: too late takes no slot; in time, or with no deadline, a slot while one is free.
    held = limiter.inflight
    assert limiter.enter(now, now + 0.4) == TOO_LATE and limiter.inflight == held
    assert limiter.enter(now, now + 0.6) == TAKEN and limiter.enter(now, None) == TAKEN
    while limiter.inflight < limiter.limit:
        limiter.try_acquire(now)
    assert limiter.enter(now, None) == OVER
    for _ in range(limiter.inflight - held):
        limiter.release(now, math.nan)  # no sample: the figures below stay as they were
    now = serve(limiter, now, 1.0, 0.05)  # it got fast again: the latest window says so
    assert limiter.recent == 0.05 and not limiter.too_late(now, now + 0.4)


def test_an_old_fastest_latency_refuses_nothing_so_requests_measure_afresh() -> None:
    # A slow spell leaves a fastest latency of 3 s; if callers then have 2 s, each is too late and
    # none takes a slot, so no window closes to lower the figure: it must go stale instead.
    limiter = Limiter(POLICY)
    now = serve(limiter, 0.0, 1.0, 3.0)
    assert limiter.recent == 3.0 and limiter.too_late(now, now + 2.0)
    later = now + 4 * 3.0 + 0.01  # STALE windows' worth of time with no window closing
    assert not limiter.too_late(later, later + 2.0)
    serve(limiter, later, 1.0, 0.05)  # the requests let through measure the service as it is now
    assert limiter.recent == 0.05


def test_a_release_too_many_never_goes_below_zero() -> None:
    limiter = Limiter(POLICY)
    limiter.release(0.0, 0.01)
    assert limiter.inflight == 0


@pytest.mark.parametrize(("field", "value"), [
    ("initial_limit", 0), ("initial_limit", 2.5), ("initial_limit", True), ("min_limit", 0),
    ("max_limit", 10**7), ("min_samples", 0), ("interval", 0), ("interval", math.nan),
    ("tolerance", 0.9), ("tolerance", "2"), ("headroom", -1), ("smoothing", 0),
    ("smoothing", 1.5), ("baseline_window", 0), ("pushback", -0.1), ("pushback", math.inf),
])  # fmt: skip
def test_bad_policy_values_are_refused(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        ConcurrencyPolicy(**{field: value})  # type: ignore[arg-type]


def test_limits_out_of_order_are_refused() -> None:
    with pytest.raises(ValueError, match="min_limit <= initial_limit <= max_limit"):
        ConcurrencyPolicy(initial_limit=50, max_limit=40)


@given(st.lists(st.tuples(st.booleans(), st.floats(0, 5), st.booleans()), max_size=300))
def test_in_flight_and_limit_stay_in_bounds(ops: list[tuple[bool, float, bool]]) -> None:
    policy = ConcurrencyPolicy(initial_limit=8, min_limit=2, max_limit=30, min_samples=1,
                               interval=0.01)
    limiter, now, held = Limiter(policy), 0.0, 0
    for acquire, latency, ok in ops:
        now += 0.01
        if acquire:
            held += limiter.try_acquire(now)
        elif held:
            held -= 1
            limiter.release(now, latency, ok)
        assert 0 <= limiter.inflight == held <= max(limiter.limit, held)
        assert policy.min_limit <= limiter.limit <= policy.max_limit
