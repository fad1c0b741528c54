"""Tests for the sans-IO circuit breaker: every clock is injected, nothing sleeps."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from askonce.core.breaker import Breaker, BreakerPolicy, State, Transition

CLOSED, OPEN, HALF = State.CLOSED, State.OPEN, State.HALF_OPEN

# Small numbers keep scenarios readable: judge after 4 calls, open at 50%, probe twice after 5 s.
BASE: dict[str, Any] = dict(window_size=10, minimum_calls=4, failure_rate=0.5, open_for=5.0, half_open_probes=2)
SLOW = dict(BASE, slow_call_duration=1.0, slow_call_rate=0.5)

# Four failures at t=1 open the breaker (BASE), so probes are admitted from t=6.
OPEN_AT_1 = [("fail", 1.0)] * 4


def run(breaker: Breaker, steps: list[tuple[Any, ...]]) -> None:
    """Play a script; ``allow`` and ``state`` steps carry the expected answer."""
    for n, step in enumerate(steps):
        op, now = step[0], step[1]
        if op == "ok":
            breaker.record(now, success=True, duration=step[2] if len(step) > 2 else 0.0)
        elif op == "fail":
            breaker.record(now, success=False, duration=step[2] if len(step) > 2 else 0.0)
        elif op == "release":
            breaker.release(now)
        elif op == "allow":
            assert breaker.allow(now) is step[2], f"step {n}: {step}"
        elif op == "state":
            assert breaker.state_at(now) is step[2], f"step {n}: {step}"
        elif op == "force_open":
            breaker.force_open(now)
        elif op == "force_closed":
            breaker.force_closed(now)
        else:  # pragma: no cover - a typo in a script
            raise AssertionError(f"unknown op {op!r}")


SCENARIOS = [
    # (id, policy, steps, final state, reasons of all transitions)
    ("below-minimum-never-opens", BASE, [("fail", 0.0)] * 3, CLOSED, []),
    (
        "rate-exactly-at-threshold-opens",
        BASE,
        [("ok", 0), ("ok", 0), ("fail", 0), ("fail", 0)],
        OPEN,
        ["failure-rate"],
    ),
    (
        "rate-below-threshold-stays-closed",
        BASE,
        [("ok", 0), ("ok", 0), ("ok", 0), ("fail", 0), ("fail", 0)],
        CLOSED,
        [],
    ),
    (
        "judged-as-soon-as-minimum-reached",
        BASE,
        [("fail", 0), ("fail", 0), ("fail", 0), ("state", 0, CLOSED), ("fail", 0)],
        OPEN,
        ["failure-rate"],
    ),
    (
        "rate-one-needs-every-call-failing",
        dict(BASE, failure_rate=1.0),
        [("fail", 0)] * 3 + [("ok", 0)] + [("fail", 0)] * 5,
        CLOSED,
        [],
    ),
    (
        "slow-call-rate-opens",
        SLOW,
        [("ok", 0, 1.0), ("ok", 0, 5.0), ("ok", 0), ("ok", 0)],
        OPEN,
        ["slow-call-rate"],
    ),
    (
        "failed-slow-calls-count-as-slow",
        dict(SLOW, failure_rate=1.0),
        [("fail", 0, 2.0), ("fail", 0, 2.0), ("ok", 0), ("ok", 0)],
        OPEN,
        ["slow-call-rate"],
    ),
    ("just-under-slow-duration-is-fast", SLOW, [("ok", 0, 0.999)] * 6, CLOSED, []),
    (
        "slow-calls-ignored-without-duration",
        dict(BASE, slow_call_rate=0.1),
        [("ok", 0, 100.0)] * 6,
        CLOSED,
        [],
    ),
    ("failure-rate-reported-before-slow", SLOW, [("fail", 0, 2.0)] * 4, OPEN, ["failure-rate"]),
    (
        "open-rejects-until-open-for-then-admits-exactly-probes",
        BASE,
        [
            *OPEN_AT_1,
            ("allow", 1.0, False),
            ("allow", 5.999, False),
            ("state", 5.999, OPEN),
            ("allow", 6.0, True),
            ("allow", 6.0, True),
            ("allow", 6.5, False),
            ("allow", 60.0, False),
        ],
        HALF,
        ["failure-rate", "open-elapsed"],
    ),
    (
        "probe-failure-reopens",
        BASE,
        [
            *OPEN_AT_1,
            ("allow", 6, True),
            ("allow", 6, True),
            ("fail", 7),
            ("allow", 7, False),
            ("allow", 11.9, False),
            ("allow", 12, True),
        ],
        HALF,
        ["failure-rate", "open-elapsed", "probe-failed", "open-elapsed"],
    ),
    (
        "all-probes-succeeding-closes",
        BASE,
        [
            *OPEN_AT_1,
            ("allow", 6, True),
            ("allow", 6, True),
            ("ok", 6.5),
            ("state", 6.5, HALF),
            ("ok", 7),
            ("allow", 7, True),
        ],
        CLOSED,
        ["failure-rate", "open-elapsed", "probes-succeeded"],
    ),
    (
        "release-frees-a-probe-slot",
        BASE,
        [
            *OPEN_AT_1,
            ("allow", 6, True),
            ("allow", 6, True),
            ("allow", 6, False),
            ("release", 6.1),
            ("allow", 6.2, True),
            ("allow", 6.2, False),
        ],
        HALF,
        ["failure-rate", "open-elapsed"],
    ),
    (
        "released-probe-is-not-a-success",
        BASE,
        [
            *OPEN_AT_1,
            ("allow", 6, True),
            ("allow", 6, True),
            ("release", 6),
            ("ok", 6),
            ("state", 6, HALF),
            ("allow", 6, True),
            ("ok", 6),
        ],
        CLOSED,
        ["failure-rate", "open-elapsed", "probes-succeeded"],
    ),
    (
        "release-in-closed-counts-nothing",
        BASE,
        [("fail", 0)] * 3 + [("release", 0)] * 5 + [("fail", 0)],
        OPEN,
        ["failure-rate"],
    ),
    (
        "straggler-in-half-open-without-probe-is-ignored",
        BASE,
        [*OPEN_AT_1, ("state", 6, HALF), ("fail", 6), ("ok", 6), ("ok", 6), ("allow", 6, True)],
        HALF,
        ["failure-rate", "open-elapsed"],
    ),
    (
        "outcomes-recorded-while-open-are-ignored",
        BASE,
        [*OPEN_AT_1, ("ok", 2), ("ok", 3), ("state", 5, OPEN)],
        OPEN,
        ["failure-rate"],
    ),
    (
        "slow-probe-reopens",
        SLOW,
        [*OPEN_AT_1, ("allow", 6, True), ("ok", 6, 3.0)],
        OPEN,
        ["failure-rate", "open-elapsed", "probe-slow"],
    ),
    (
        "count-window-forgets-calls-older-than-window-size",
        dict(BASE, window_size=4, failure_rate=0.4),
        # Unwindowed this would be 2/5 = 0.4 and open; the first failure has left the 4-call window.
        [("fail", 0), ("ok", 0), ("ok", 0), ("ok", 0), ("fail", 0)],
        CLOSED,
        [],
    ),
    (
        "count-window-still-opens-on-recent-failures",
        dict(BASE, window_size=4, failure_rate=0.4),
        [("fail", 0), ("ok", 0), ("ok", 0), ("ok", 0), ("fail", 0), ("fail", 0)],
        OPEN,
        ["failure-rate"],
    ),
    (
        "time-window-drops-failures-after-window-size-seconds",
        dict(BASE, window="time"),
        [("fail", 0.0), ("fail", 0.5), ("ok", 10.0), ("ok", 10.0)],
        CLOSED,
        [],
    ),
    (
        "time-window-keeps-failures-inside-window",
        dict(BASE, window="time"),
        [("fail", 0.0), ("fail", 0.5), ("ok", 9.99), ("ok", 9.99)],
        OPEN,
        ["failure-rate"],
    ),
    (
        "time-window-minimum-calls-may-exceed-size",
        dict(BASE, window="time", window_size=2, minimum_calls=4),
        [("fail", 0.0), ("fail", 0.1), ("fail", 1.2), ("fail", 1.3)],
        OPEN,
        ["failure-rate"],
    ),
    (
        "time-going-backwards-is-clamped",
        BASE,
        [
            ("fail", 100),
            ("fail", 50),
            ("fail", 0),
            ("fail", -1e9),
            ("allow", 3, False),
            ("allow", 104.9, False),
            ("allow", 105, True),
        ],
        HALF,
        ["failure-rate", "open-elapsed"],
    ),
    (
        "force-open-from-closed-then-probes",
        BASE,
        [("force_open", 0), ("allow", 4.9, False), ("allow", 5, True)],
        HALF,
        ["forced", "open-elapsed"],
    ),
    (
        "force-closed-from-open",
        BASE,
        [*OPEN_AT_1, ("force_closed", 2), ("allow", 2, True)],
        CLOSED,
        ["failure-rate", "forced"],
    ),
    (
        "force-open-again-restarts-open-period",
        BASE,
        [("force_open", 0), ("force_open", 3), ("allow", 7.9, False), ("allow", 8, True)],
        HALF,
        ["forced", "open-elapsed"],
    ),
    (
        "force-closed-while-closed-forgives-window",
        BASE,
        [("fail", 0)] * 3 + [("force_closed", 0), ("fail", 0), ("ok", 0), ("ok", 0), ("ok", 0)],
        CLOSED,
        [],
    ),
]


@pytest.mark.parametrize(
    ("policy", "steps", "final", "reasons"), [s[1:] for s in SCENARIOS], ids=[s[0] for s in SCENARIOS]
)
def test_transitions(policy: dict[str, Any], steps: list[tuple[Any, ...]], final: State, reasons: list[str]) -> None:
    breaker = Breaker(BreakerPolicy(**policy))
    run(breaker, steps)
    assert breaker.state is final
    assert [t.reason for t in breaker.drain_transitions()] == reasons


def test_transitions_carry_old_new_and_time_and_drain_empties() -> None:
    breaker = Breaker(BreakerPolicy(**BASE))
    run(breaker, [*OPEN_AT_1, ("allow", 7.5, True), ("fail", 8.0)])
    assert breaker.drain_transitions() == [
        Transition(CLOSED, OPEN, 1.0, "failure-rate"),
        # Effective at the deadline (1 + 5), not when the allow() at 7.5 noticed it.
        Transition(OPEN, HALF, 6.0, "open-elapsed"),
        Transition(HALF, OPEN, 8.0, "probe-failed"),
    ]
    assert breaker.drain_transitions() == []
    run(breaker, [("allow", 13, True), ("ok", 13), ("allow", 13, True), ("ok", 13)])
    assert breaker.drain_transitions() == [
        Transition(OPEN, HALF, 13.0, "open-elapsed"),
        Transition(HALF, CLOSED, 13.0, "probes-succeeded"),
    ]


def test_retry_at_is_when_a_probe_is_admitted_and_moves_on_reopen() -> None:
    breaker = Breaker(BreakerPolicy(**BASE))
    assert breaker.retry_at() is None
    run(breaker, OPEN_AT_1)
    assert breaker.retry_at() == 6.0
    assert breaker.allow(math.nextafter(6.0, 0)) is False
    assert breaker.allow(breaker.retry_at() or 0.0) is True
    assert breaker.retry_at() is None  # half-open
    breaker.record(9.0, success=False)
    assert breaker.retry_at() == 14.0


def test_state_property_does_not_advance_time() -> None:
    breaker = Breaker(BreakerPolicy(**BASE))
    run(breaker, OPEN_AT_1)
    assert breaker.state_at(5.0) is OPEN
    assert breaker.state is OPEN
    assert breaker.state_at(6.0) is HALF
    assert breaker.state is HALF


def test_window_is_reset_on_opening_and_on_closing() -> None:
    breaker = Breaker(BreakerPolicy(**BASE))
    run(breaker, [("ok", 0), ("fail", 0), ("fail", 0)])
    assert breaker.snapshot()["calls"] == 3
    assert breaker.snapshot()["failures"] == 2
    run(breaker, [("ok", 1), ("fail", 1)])  # 3/5 opens
    assert (breaker.snapshot()["calls"], breaker.snapshot()["failures"]) == (0, 0)
    run(breaker, [("fail", 2), ("fail", 3)])  # late stragglers while open
    assert breaker.snapshot()["calls"] == 0
    run(breaker, [("allow", 6, True), ("allow", 6, True), ("ok", 6), ("ok", 6)])
    assert breaker.state is CLOSED
    assert (breaker.snapshot()["calls"], breaker.snapshot()["failures"]) == (0, 0)
    # Three fresh failures would open a window still holding the two from before opening.
    run(breaker, [("fail", 7)] * 3)
    assert breaker.state is CLOSED


def test_count_window_totals_after_wrapping() -> None:
    breaker = Breaker(BreakerPolicy(window_size=3, minimum_calls=3, failure_rate=1.0, slow_call_duration=1.0))
    run(breaker, [("fail", 0), ("ok", 0, 2.0), ("ok", 0), ("ok", 0), ("fail", 0, 1.0)])
    snap = breaker.snapshot()
    assert (snap["calls"], snap["failures"], snap["slow"]) == (3, 1, 1)


def test_time_window_buckets_are_whole_seconds() -> None:
    breaker = Breaker(BreakerPolicy(window="time", window_size=10, minimum_calls=1, failure_rate=1.0))
    run(breaker, [("ok", 3.7), ("ok", 5.2)])
    assert breaker.snapshot()["calls"] == 2
    breaker.state_at(12.99)  # second 3 is still one of the last ten
    assert breaker.snapshot()["calls"] == 2
    breaker.state_at(13.0)
    assert breaker.snapshot()["calls"] == 1
    breaker.state_at(1e6)  # a gap longer than the window empties it
    assert breaker.snapshot()["calls"] == 0
    breaker.record(1e6 + 0.5, success=True)
    assert breaker.snapshot()["calls"] == 1


def test_time_window_reset_orphans_buckets_that_age_out_later() -> None:
    # Second 1000's failure is still in its bucket when the breaker opens at 1002 and closes at 1003;
    # when that bucket ages out at 1006 it must not be subtracted from the fresh window a second time.
    policy = BreakerPolicy(
        window="time", window_size=6, minimum_calls=2, failure_rate=0.5, open_for=1.0, half_open_probes=1
    )
    breaker = Breaker(policy)
    run(breaker, [("fail", 1000.0), ("fail", 1002.0), ("allow", 1003.0, True), ("ok", 1003.0)])
    assert breaker.state is CLOSED
    run(breaker, [("ok", 1004.0), ("state", 1006.0, CLOSED)])
    snap = breaker.snapshot()
    assert (snap["calls"], snap["failures"], snap["slow"]) == (1, 0, 0)
    run(breaker, [("fail", 1006.0)])  # 1/2 would open; a corrupted count of 1 call would not judge
    assert breaker.state is OPEN


def test_time_going_backwards_keeps_latest_time() -> None:
    breaker = Breaker(BreakerPolicy(**BASE))
    run(breaker, [("ok", 50), *OPEN_AT_1])  # times 1.0 are clamped to 50
    assert breaker.drain_transitions() == [Transition(CLOSED, OPEN, 50.0, "failure-rate")]
    assert breaker.retry_at() == 55.0
    assert breaker.snapshot()["now"] == 50


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_time_is_rejected(bad: float) -> None:
    with pytest.raises(ValueError, match="finite"):
        Breaker().allow(bad)


def test_drain_keeps_only_the_last_64_and_counts_the_dropped() -> None:
    breaker = Breaker(BreakerPolicy(**BASE))
    for i in range(50):
        breaker.force_open(float(i))
        breaker.force_closed(float(i))
    drained = breaker.drain_transitions()
    assert len(drained) == 64
    assert drained[-1] == Transition(OPEN, CLOSED, 49.0, "forced")
    assert drained[0].at == 18.0  # the first 36 of the 100 were dropped
    assert breaker.snapshot()["transitions_dropped"] == 36


def test_snapshot_shape() -> None:
    breaker = Breaker(BreakerPolicy(**BASE))
    run(breaker, [*OPEN_AT_1])
    snap = breaker.snapshot()
    assert snap["state"] == "open"
    assert snap["opened_at"] == 1.0
    assert snap["retry_at"] == 6.0
    assert snap["transitions_pending"] == 1
    breaker.allow(6.0)
    assert breaker.snapshot()["state"] == "half-open"
    assert breaker.snapshot()["probes_admitted"] == 1


def test_state_values() -> None:
    assert [s.value for s in State] == ["closed", "open", "half-open"]


def test_policy_and_transition_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        BreakerPolicy().open_for = 1.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        Transition(CLOSED, OPEN, 0.0, "forced").at = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(window="sliding"),
        dict(window_size=0),
        dict(window_size=-5),
        dict(window_size=True),
        dict(window_size=2.5),
        dict(window_size=10**7),
        dict(window="time", window_size=86_401, minimum_calls=1),
        dict(minimum_calls=0),
        dict(minimum_calls=1.5),
        dict(window_size=10, minimum_calls=11),  # a count window could never hold enough calls
        dict(failure_rate=0.0),
        dict(failure_rate=-0.1),
        dict(failure_rate=1.01),
        dict(failure_rate=math.nan),
        dict(failure_rate="0.5"),
        dict(slow_call_rate=0.0),
        dict(slow_call_rate=2.0),
        dict(slow_call_rate=math.nan),
        dict(slow_call_duration=0.0),
        dict(slow_call_duration=-1.0),
        dict(slow_call_duration=math.inf),
        dict(slow_call_duration=math.nan),
        dict(open_for=0.0),
        dict(open_for=-1.0),
        dict(open_for=math.inf),
        dict(open_for=math.nan),
        dict(half_open_probes=0),
        dict(half_open_probes=2.0),
        dict(half_open_probes=False),
    ],
    ids=repr,
)
def test_policy_validation_rejects(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        BreakerPolicy(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(window="time", window_size=1, minimum_calls=1000),
        dict(window="time", window_size=86_400),
        dict(window_size=1_000_000),
        dict(window_size=1, minimum_calls=1, failure_rate=1.0, slow_call_rate=1.0, slow_call_duration=0.001),
        dict(open_for=0.001, half_open_probes=1),
    ],
    ids=repr,
)
def test_policy_validation_accepts(kwargs: dict[str, Any]) -> None:
    Breaker(BreakerPolicy(**kwargs)).allow(0.0)


# --- model-based property test -------------------------------------------------------------------------


class Model:
    """A naive reference breaker: keeps every outcome and recounts the window from scratch each time."""

    def __init__(self, policy: BreakerPolicy) -> None:
        self.p = policy
        self.state = CLOSED
        self.now: float | None = None
        self.opened_at = 0.0
        self.outcomes: list[tuple[int, bool, bool]] = []  # (second, failed, slow) since the last reset
        self.admitted = 0
        self.succeeded = 0
        self.reasons: list[str] = []

    def window(self) -> tuple[int, int, int]:
        if self.p.window == "count":
            kept = self.outcomes[-self.p.window_size :]
        else:
            head = math.floor(self.now or 0.0)
            kept = [o for o in self.outcomes if o[0] > head - self.p.window_size]
        return len(kept), sum(o[1] for o in kept), sum(o[2] for o in kept)

    def move(self, state: State, reason: str, now: float) -> None:
        self.state, self.admitted, self.succeeded = state, 0, 0
        self.reasons.append(reason)
        if state is not HALF:
            self.outcomes = []
        if state is OPEN:
            self.opened_at = now

    def tick(self, now: float) -> float:
        self.now = now if self.now is None else max(self.now, now)
        if self.state is OPEN and self.now >= self.opened_at + self.p.open_for:
            self.move(HALF, "open-elapsed", self.opened_at + self.p.open_for)
        return self.now

    def allow(self, now: float) -> bool:
        self.tick(now)
        if self.state is CLOSED:
            return True
        if self.state is HALF and self.admitted < self.p.half_open_probes:
            self.admitted += 1
            return True
        return False

    def record(self, now: float, success: bool, duration: float) -> None:
        now = self.tick(now)
        slow = self.p.slow_call_duration is not None and duration >= self.p.slow_call_duration
        if self.state is CLOSED:
            self.outcomes.append((math.floor(now), not success, slow))
            calls, failures, slows = self.window()
            if calls >= self.p.minimum_calls:
                if failures / calls >= self.p.failure_rate:
                    self.move(OPEN, "failure-rate", now)
                elif self.p.slow_call_duration is not None and slows / calls >= self.p.slow_call_rate:
                    self.move(OPEN, "slow-call-rate", now)
        elif self.state is HALF and self.admitted > self.succeeded:
            if not success or slow:
                self.move(OPEN, "probe-failed" if not success else "probe-slow", now)
            else:
                self.succeeded += 1
                if self.succeeded == self.p.half_open_probes:
                    self.move(CLOSED, "probes-succeeded", now)

    def release(self, now: float) -> None:
        self.tick(now)
        if self.state is HALF and self.admitted > self.succeeded:
            self.admitted -= 1


@st.composite
def policies(draw: st.DrawFn) -> BreakerPolicy:
    window: Literal["count", "time"] = draw(st.sampled_from(["count", "time"]))
    size = draw(st.integers(1, 6))
    return BreakerPolicy(
        window=window,
        window_size=size,
        minimum_calls=draw(st.integers(1, size if window == "count" else 8)),
        failure_rate=draw(st.sampled_from([0.25, 1 / 3, 0.5, 0.6, 1.0])),
        slow_call_rate=draw(st.sampled_from([0.5, 1.0])),
        slow_call_duration=draw(st.sampled_from([None, 1.0])),
        open_for=draw(st.sampled_from([1.0, 2.5])),
        half_open_probes=draw(st.integers(1, 3)),
    )


steps = st.lists(
    st.tuples(
        # Exact steps hit bucket and deadline boundaries; negative ones exercise the clock clamp.
        st.one_of(st.sampled_from([0.0, 0.0, 0.5, 1.0, 2.5, 7.0]), st.floats(-3.0, 12.0)),
        st.sampled_from(["allow", "allow", "ok", "ok", "fail", "fail", "release", "state", "force"]),
        st.sampled_from([0.0, 0.5, 1.0, 3.0]),
    ),
    max_size=120,
)


@settings(max_examples=400, deadline=None)
@given(policy=policies(), script=steps)
def test_breaker_agrees_with_brute_force_model(policy: BreakerPolicy, script: list[tuple[float, str, float]]) -> None:
    breaker, model = Breaker(policy), Model(policy)
    now = 1000.0
    for dt, op, duration in script:
        now += dt
        if op == "allow":
            assert breaker.allow(now) is model.allow(now)
        elif op in ("ok", "fail"):
            breaker.record(now, success=op == "ok", duration=duration)
            model.record(now, op == "ok", duration)
        elif op == "release":
            breaker.release(now)
            model.release(now)
        elif op == "state":
            model.tick(now)
            assert breaker.state_at(now) is model.state
        else:
            # Rare manual overrides, driven by the duration draw so they stay uncommon but reachable.
            at = model.tick(now)
            if duration >= 1.0:
                breaker.force_open(now)
                if model.state is OPEN:
                    model.opened_at = at
                else:
                    model.move(OPEN, "forced", at)
            else:
                breaker.force_closed(now)
                if model.state is CLOSED:
                    model.outcomes = []
                else:
                    model.move(CLOSED, "forced", at)

        snap = breaker.snapshot()
        assert breaker.state is model.state
        assert (snap["calls"], snap["failures"], snap["slow"]) == model.window()
        assert snap["probes_admitted"] == model.admitted
        assert 0 <= snap["probes_admitted"] <= policy.half_open_probes
        if model.state is OPEN:
            assert breaker.retry_at() == model.opened_at + policy.open_for
        else:
            assert breaker.retry_at() is None
    assert [t.reason for t in breaker.drain_transitions()] == model.reasons[-64:]


# --- bulk successes and the quiet horizon (what lets a shell count successes without its lock) ---------


def test_quiet_until_count_window_once_minimum_calls_are_in() -> None:
    breaker = Breaker(BreakerPolicy(**BASE))
    assert breaker.quiet_until == -math.inf  # no time seen, no calls
    run(breaker, [("ok", 0), ("fail", 0), ("ok", 0)])
    assert breaker.quiet_until == -math.inf  # 3 < minimum_calls: the 4th call is judged
    run(breaker, [("ok", 0)])
    assert breaker.quiet_until == math.inf  # 1/4 failed: more successes only lower the rate
    run(breaker, [("fail", 0), ("fail", 0)])  # 3/6 = 0.5 opens
    assert breaker.state is OPEN and breaker.quiet_until == -math.inf
    run(breaker, [("allow", 6, True), ("ok", 6)])
    assert breaker.state is HALF and breaker.quiet_until == -math.inf  # successes here are probes


def test_quiet_until_time_window_ends_with_the_second() -> None:
    # Outcomes age out second by second, so a success in a later second can find a higher failure rate:
    # three successes at 0 and two failures at 5 are 2/5; at 10.5 the successes have gone, and one more
    # success makes 2/3 >= 0.5 and opens.
    breaker = Breaker(BreakerPolicy(**dict(BASE, window="time", minimum_calls=2)))
    run(breaker, [("ok", 0.0)] * 3 + [("fail", 5.2)] * 2)
    assert breaker.state is CLOSED and breaker.quiet_until == 6.0
    assert breaker.state_at(10.5) is CLOSED and breaker.quiet_until == -math.inf
    breaker.record(10.5, success=True)
    assert breaker.state is OPEN


def test_quiet_until_counts_slow_calls_when_judged() -> None:
    breaker = Breaker(BreakerPolicy(**dict(SLOW, failure_rate=1.0, slow_call_rate=0.75)))
    run(breaker, [("ok", 0, 2.0), ("ok", 0, 2.0), ("ok", 0), ("ok", 0)])
    assert breaker.quiet_until == math.inf  # 2/4 slow < 0.75
    run(breaker, [("fail", 0, 5.0)])  # 3/5 slow, still closed
    assert breaker.quiet_until == math.inf


def test_record_successes_in_bulk_fill_and_clear_a_count_window() -> None:
    breaker = Breaker(BreakerPolicy(window_size=1000, minimum_calls=1000, failure_rate=0.5, slow_call_duration=1.0))
    run(breaker, [("fail", 0), ("ok", 0, 3.0), ("fail", 0, 3.0)])
    breaker.record_successes(1.0, 996)
    snap = breaker.snapshot()
    assert (snap["calls"], snap["failures"], snap["slow"]) == (999, 2, 2)
    breaker.record_successes(1.0, 2)  # the first failure leaves the window
    snap = breaker.snapshot()
    assert (snap["calls"], snap["failures"], snap["slow"]) == (1000, 1, 2)
    breaker.record_successes(2.0, 10**12)  # no loop over n
    snap = breaker.snapshot()
    assert (snap["calls"], snap["failures"], snap["slow"], snap["now"]) == (1000, 0, 0, 2.0)
    run(breaker, [("fail", 2)] * 500)  # the ring holds only successes now: 500/1000 opens on the 500th
    assert breaker.state is OPEN


def test_record_successes_opens_at_the_call_that_reaches_minimum_calls() -> None:
    breaker = Breaker(BreakerPolicy(**BASE))
    run(breaker, [("fail", 0)] * 3)
    breaker.record_successes(1.0, 50)  # 3/4 at the fourth call: open; the other 49 arrive while open
    assert breaker.state is OPEN
    assert breaker.drain_transitions() == [Transition(CLOSED, OPEN, 1.0, "failure-rate")]
    assert breaker.snapshot()["calls"] == 0


def test_record_successes_close_a_half_open_breaker_and_feed_the_fresh_window() -> None:
    breaker = Breaker(BreakerPolicy(**BASE))
    run(breaker, [*OPEN_AT_1, ("allow", 6, True), ("allow", 6, True)])
    breaker.record_successes(7.0, 5)  # two probes succeed, three more calls land in the closed window
    assert breaker.state is CLOSED
    assert breaker.snapshot()["calls"] == 3
    assert [t.reason for t in breaker.drain_transitions()] == ["failure-rate", "open-elapsed", "probes-succeeded"]


def test_record_successes_in_half_open_without_probes_are_stragglers() -> None:
    breaker = Breaker(BreakerPolicy(**BASE))
    run(breaker, [*OPEN_AT_1, ("allow", 6, True)])
    breaker.record_successes(6.5, 3)  # one probe in flight succeeds; two stragglers are ignored
    snap = breaker.snapshot()
    assert (snap["state"], snap["probes_admitted"], snap["probes_succeeded"]) == ("half-open", 1, 1)
    breaker.record_successes(7.0, 0)  # nothing but the clock
    assert breaker.snapshot()["now"] == 7.0


@pytest.mark.parametrize("n", [-1, True, 2.0, "3", None])
def test_record_successes_rejects_a_bad_count(n: Any) -> None:
    with pytest.raises(ValueError, match="int n >= 0"):
        Breaker().record_successes(0.0, n)


def test_record_successes_rejects_non_finite_time() -> None:
    with pytest.raises(ValueError, match="finite"):
        Breaker().record_successes(math.nan, 1)


bulk_steps = st.lists(
    st.tuples(
        st.one_of(st.sampled_from([0.0, 0.0, 0.25, 0.5, 1.0, 2.5, 7.0]), st.floats(-3.0, 12.0)),
        st.sampled_from(["allow", "allow", "oks", "oks", "ok", "fail", "fail", "release", "state", "force"]),
        # the duration of a single call, or how many successes an "oks" step records
        st.sampled_from([0.0, 0.5, 1.0, 3.0, 2, 5, 17]),
    ),
    max_size=80,
)


@settings(max_examples=400, deadline=None)
@given(policy=policies(), script=bulk_steps)
def test_record_successes_is_n_records_and_quiet_until_holds(
    policy: BreakerPolicy, script: list[tuple[float, str, float]]
) -> None:
    bulk, one_by_one = Breaker(policy), Breaker(policy)
    now = 1000.0
    for dt, op, arg in script:
        now += dt
        if op == "allow":
            assert bulk.allow(now) is one_by_one.allow(now)
        elif op in ("ok", "fail"):
            for b in (bulk, one_by_one):
                b.record(now, success=op == "ok", duration=arg)
        elif op == "oks":
            n = int(arg)
            quiet_until, before = bulk.quiet_until, bulk.state
            bulk.record_successes(now, n)
            one_by_one.state_at(now)
            for _ in range(n):
                one_by_one.record(now, success=True)
            if now < quiet_until:
                # The promise a lock-free shell relies on: closed before, closed after, no transition.
                assert before is CLOSED and bulk.state is CLOSED
                assert bulk.quiet_until >= quiet_until
        elif op == "release":
            bulk.release(now)
            one_by_one.release(now)
        elif op == "state":
            assert bulk.state_at(now) is one_by_one.state_at(now)
        elif arg >= 1.0:
            bulk.force_open(now)
            one_by_one.force_open(now)
        else:
            bulk.force_closed(now)
            one_by_one.force_closed(now)
        assert bulk.snapshot() == one_by_one.snapshot()
        assert bulk.quiet_until == one_by_one.quiet_until
        if bulk.state is not CLOSED:
            assert bulk.quiet_until == -math.inf
    assert bulk.drain_transitions() == one_by_one.drain_transitions()
