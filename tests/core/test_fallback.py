"""core.fallback: a local fallback seeded from the shared state last seen, on a 1/N share of the
fleet; and the core pieces it uses (``Breaker.hold_open``, ``Admission.add``)."""

from __future__ import annotations

import math
import random

import pytest

from askonce.core.admission import Admission, AdmissionPolicy
from askonce.core.breaker import Breaker, BreakerPolicy, State
from askonce.core.bucket import BucketPolicy, TokenBucket
from askonce.core.fallback import (
    MAX_FLEET,
    breaker_share,
    bucket_share,
    first_probe,
    fleet_size,
    seeded_bucket,
)

CLOSED, OPEN, HALF = State.CLOSED, State.OPEN, State.HALF_OPEN


@pytest.mark.parametrize(("counted", "hint", "n"), [
    (0, 1, 1), (7, 1, 7), (3, 20, 20), (10**9, 1, MAX_FLEET), (-5, 1, 1), (True, 1, 1),
    ("12", 1, 1), (None, 4, 4), (2.5, 1, 1)])
def test_fleet_size_is_a_clamped_count_or_the_hint(counted: object, hint: int, n: int) -> None:
    assert fleet_size(counted, hint) == n


def test_a_breaker_seen_closed_starts_closed() -> None:
    assert first_probe(CLOSED, None, 100.0, 2.0, 20, 0.7) is None


def test_a_breaker_seen_open_stays_open_until_the_shared_retry_at_then_a_1_in_n_share() -> None:
    # u = 0: the shared retry_at itself; u near 1: the end of the fleet's spread
    assert first_probe(OPEN, 105.0, 100.0, 2.0, 20, 0.0) == 105.0
    last = first_probe(OPEN, 105.0, 100.0, 2.0, 20, 0.999999)
    assert last is not None and 105.0 + 37.9 < last < 105.0 + 38.0
    assert first_probe(OPEN, 105.0, 100.0, 2.0, 1, 0.9) == 105.0  # alone: the shared schedule
    # a view whose retry_at passed: the probes were due now, not in the past
    assert first_probe(OPEN, 90.0, 100.0, 2.0, 3, 0.5) == 100.0 + 0.5 * 2 * 2.0
    # half-open (no retry_at): the probes are due now
    assert first_probe(HALF, None, 100.0, 2.0, 3, 0.25) == 100.0 + 0.25 * 2 * 2.0
    assert first_probe(OPEN, math.nan, 100.0, 2.0, 1, 0.0) == 100.0
    with pytest.raises(ValueError):
        first_probe(OPEN, 105.0, 100.0, 2.0, 3, math.nan)


def test_shares_divide_the_fleet_wide_rates() -> None:
    policy = BreakerPolicy(failure_rate=0.5, minimum_calls=20, open_for=2.0)
    assert breaker_share(policy, 1) is policy
    share = breaker_share(policy, 20)
    assert share.open_for == 40.0 and share.minimum_calls == 20 and share.half_open_probes == 3
    bucket = BucketPolicy(ratio=0.2, floor=10.0, max_tokens=100.0)
    assert bucket_share(bucket, 1) is bucket
    assert bucket_share(bucket, 20) == BucketPolicy(ratio=0.2, floor=0.5, max_tokens=5.0)


def test_a_bucket_seen_drained_stays_drained_and_refills_at_its_share() -> None:
    policy = bucket_share(BucketPolicy(ratio=0.0, floor=10.0, max_tokens=100.0), 20)
    local = seeded_bucket(policy, 0.0, 0.0, 0.0, 20)
    assert not local.withdraw(0.0)  # a fresh bucket would have granted its floor at once
    assert not local.withdraw(1.9)  # 0.5 tokens a second: the fleet's 10 over 20 processes
    assert local.withdraw(2.0) and not local.withdraw(2.0)
    fresh = TokenBucket(policy, 0.0)
    assert fresh.withdraw(0.0)


def test_a_bucket_seeded_with_a_level_holds_its_share_of_it() -> None:
    policy = bucket_share(BucketPolicy(ratio=0.2, floor=0.0, max_tokens=100.0), 4)
    local = seeded_bucket(policy, 0.0, 40.0, 0.0, 4)
    assert sum(local.withdraw(0.0) for _ in range(20)) == 10
    capped = seeded_bucket(policy, 0.0, 1e9, 1e9, 4)  # more than the share can hold: capped
    assert capped.tokens(0.0) == policy.max_tokens


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, "3", None, True])
def test_a_level_that_does_not_read_leaves_a_fresh_bucket(bad: object) -> None:
    policy = BucketPolicy(ratio=0.2, floor=2.0, max_tokens=10.0)
    local = seeded_bucket(policy, 0.0, bad, bad, 1)
    assert local.tokens(0.0) == TokenBucket(policy, 0.0).tokens(0.0)


def test_hold_open_refuses_until_the_time_given_then_probes() -> None:
    policy = BreakerPolicy(minimum_calls=5, window_size=5, open_for=10.0, half_open_probes=1)
    b = Breaker(policy)
    b.hold_open(0.0, 3.0)
    assert b.state is OPEN and b.retry_at() == 3.0 and not b.allow(2.9)
    assert [(t.old, t.new, t.reason) for t in b.drain_transitions()] == [(CLOSED, OPEN, "seeded")]
    assert b.allow(3.0) and b.state is HALF and not b.allow(3.0)
    b.record(3.1, success=False)  # the probe failed: open for the policy's open_for
    assert b.retry_at() == pytest.approx(13.1)
    b.hold_open(4.0, 30.0)  # already open: only the deadline moves, no transition
    assert b.retry_at() == 30.0 and b.drain_transitions()[-1].reason == "probe-failed"
    with pytest.raises(ValueError):
        b.hold_open(5.0, math.inf)


def test_admission_add_counts_like_one_at_a_time() -> None:
    policy = AdmissionPolicy()
    batch, single = Admission(policy), Admission(policy)
    batch.add(10.5, 40, 30, 0)
    for _ in range(40):
        single.admit(10.5, 0.999)
    for _ in range(30):
        single.record(10.5, success=False)
    assert batch.reject_probability(10.6) == single.reject_probability(10.6) > 0.9
    assert batch.reject_probability(10.6 + policy.window) == 0.0  # they age out with the window
    odd = Admission(policy)
    odd.add(0.0, -5, 3, 9)  # clamped: no negative counts, no more successes than calls
    assert odd.snapshot()["requests"] == 0 and odd.snapshot()["successes"] == 3
    with pytest.raises(ValueError):
        odd.add(0.0, 1.5, 0, 0)  # type: ignore[arg-type]


def _arrivals(breakers: list[Breaker], seconds: float, every: float) -> int:
    """Each breaker is one process calling a dead target every ``every`` seconds (staggered)."""
    arrivals = 0
    n = len(breakers)
    for step in range(int(seconds / every)):
        for i, b in enumerate(breakers):
            now = 1000.0 + step * every + i * every / n
            if b.allow(now):
                arrivals += 1
                b.record(now, success=False)
    return arrivals


@pytest.mark.parametrize("seed", range(5))
def test_n_seeded_shares_probe_a_dead_target_at_about_the_shared_rate(seed: int) -> None:
    """20 processes, a dead target, the shared breaker seen open until 1001: one shared breaker
    against 20 local ones seeded with the 1/N share, and 20 fresh ones (the fallback before)."""
    rng = random.Random(seed)
    policy = BreakerPolicy(failure_rate=0.5, minimum_calls=20, open_for=2.0)
    n, seconds, every = 20, 60.0, 0.05
    shared = Breaker(policy)
    shared.hold_open(1000.0, 1001.0)
    shared_arrivals = _arrivals([shared] * 1, seconds, every)
    seeded = []
    for _ in range(n):
        b = Breaker(breaker_share(policy, n))
        until = first_probe(OPEN, 1001.0, 1000.0, policy.open_for, n, rng.random())
        assert until is not None
        b.hold_open(1000.0, until)
        seeded.append(b)
    fresh = [Breaker(policy) for _ in range(n)]
    seeded_arrivals = _arrivals(seeded, seconds, every)
    fresh_arrivals = _arrivals(fresh, seconds, every)
    assert shared_arrivals == 30  # one probe per open_for
    assert seeded_arrivals <= 2 * shared_arrivals, (seeded_arrivals, shared_arrivals)
    assert fresh_arrivals >= n * policy.minimum_calls  # 20 x 20 before any of them opens
