"""core.hedge: the policy's bounds, the per-target Hedger (learned delay, throttle, pause) and the
Race of a first try and its hedge (who wins, what is settled)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from askonce.core.hedge import FIRST, HEDGE, HedgePolicy, Hedger, Race, wins
from askonce.core.question import Account
from askonce.core.retry import ANSWERED, LOST, REFUSED, Failure
from askonce.core.wire import Reply


@pytest.mark.parametrize("kwargs", [
    {"delay": 0}, {"delay": -1.0}, {"delay": math.nan}, {"delay": True}, {"percentile": 0.2},
    {"percentile": 1.0}, {"min_delay": -0.1}, {"max_share": 0.9}, {"max_share": "0.05"},
    {"burst": 0.5}, {"pause": math.inf}, {"window": 0}, {"every": 1.5}, {"min_samples": True},
    {"window": 10, "min_samples": 20},
])
def test_policy_refuses_what_makes_no_sense(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=r"^hedge ") as err:
        HedgePolicy(**kwargs)  # type: ignore[arg-type]
    assert "\n" not in str(err.value)


def learned(samples: list[float], **kwargs: object) -> Hedger:
    hedger = Hedger(HedgePolicy(**kwargs))  # type: ignore[arg-type]
    for s in samples:
        hedger.observe(s)
    return hedger


def test_no_learned_delay_before_min_samples_then_the_percentile() -> None:
    policy = {"min_samples": 10, "every": 5, "window": 20, "percentile": 0.9}
    hedger = learned([0.01 * i for i in range(1, 10)], **policy)
    assert hedger.plan(0.0) is None  # 9 samples
    hedger.observe(0.10)
    assert hedger.learned == pytest.approx(0.09)  # nearest rank 9 of 10
    assert hedger.plan(0.0) == pytest.approx(0.09)


def test_the_percentile_is_recomputed_every_few_samples_over_a_bounded_ring() -> None:
    hedger = learned([0.01] * 10, min_samples=10, every=5, window=10, percentile=0.9)
    for _ in range(4):
        hedger.observe(1.0)
    assert hedger.learned == pytest.approx(0.01)  # 4 new samples: not yet recomputed
    hedger.observe(1.0)
    assert hedger.learned == pytest.approx(1.0)  # 5 of the last 10 are slow
    for _ in range(10):
        hedger.observe(0.02)
    assert hedger.learned == pytest.approx(0.02)  # the slow ones have left the ring
    assert len(hedger._ring) == 10


@pytest.mark.parametrize("sample", [math.nan, -1.0, math.inf])
def test_a_sample_no_clock_could_give_is_ignored(sample: float) -> None:
    hedger = learned([sample] * 5, min_samples=1)
    assert hedger.seen == 0 and hedger.learned is None


def test_a_fixed_delay_needs_no_samples_and_the_floor_holds() -> None:
    assert Hedger(HedgePolicy(delay=0.2)).plan(0.0) == 0.2
    assert learned([0.0] * 5, min_samples=5, min_delay=0.003).plan(0.0) == 0.003


def test_hedges_are_throttled_to_their_share_of_calls() -> None:
    hedger = Hedger(HedgePolicy(delay=0.1, max_share=0.05, burst=10))
    sent = sum(1 for _ in range(2000) if hedger.plan(0.0) is not None and hedger.take(0.0))
    assert sent <= 1 + 0.05 * 2000  # one to start with, then what the calls earned
    assert sent >= 0.05 * 2000 - 1


def test_a_quiet_target_banks_no_more_than_the_burst() -> None:
    hedger = Hedger(HedgePolicy(delay=0.1, max_share=0.5, burst=3))
    for _ in range(100):
        hedger.plan(0.0)
    assert sum(hedger.take(0.0) for _ in range(10)) == 3


@pytest.mark.parametrize(("reply", "until"), [
    (Reply(0, True, "overloaded", 2.5), 12.5),  # its pushback
    (Reply(1, False, None, 4.0), 14.0),
    (Reply(0, True, "overloaded"), 11.0),  # the policy's pause
    (Reply(0, True, "shed"), 11.0),
    (Reply(0, True, "deadline"), None),  # not a word about load
    (Reply(2), None),
    (Reply(0, True, "overloaded", math.nan), None),
])
def test_a_pushback_stops_hedging_to_the_target_for_its_time(reply: Reply,
                                                              until: float | None) -> None:
    hedger = Hedger(HedgePolicy(delay=0.1, max_share=0.5, burst=5, pause=1.0))
    hedger.heard(10.0, reply)
    if until is None:
        assert hedger.plan(10.0) == 0.1
        return
    assert hedger.plan(until - 0.01) is None and not hedger.take(until - 0.01)
    assert hedger.plan(until) == 0.1 and hedger.take(until)


OK = None
RETRY = Failure(True, Reply(1), ANSWERED)
DNR = Failure(True, Reply(0, True, "overloaded", 1.0), ANSWERED)
FATAL = Failure(False, Reply(1), ANSWERED)
TIMEOUT = Failure(True, None, LOST)


@pytest.mark.parametrize(("outcomes", "pick"), [
    ([(FIRST, OK)], FIRST),
    ([(HEDGE, OK)], HEDGE),
    ([(FIRST, RETRY)], None),  # the hedge is still out: wait for it
    ([(FIRST, RETRY), (HEDGE, OK)], HEDGE),
    ([(HEDGE, RETRY), (FIRST, OK)], FIRST),
    ([(HEDGE, FATAL)], HEDGE),  # a failure no retry would change ends the race
    ([(FIRST, RETRY), (HEDGE, RETRY)], FIRST),
    ([(FIRST, RETRY), (HEDGE, DNR)], HEDGE),  # the one that says stop is passed on
    ([(HEDGE, DNR), (FIRST, TIMEOUT)], HEDGE),
    ([(FIRST, TIMEOUT), (HEDGE, RETRY)], FIRST),
])
def test_which_try_the_call_goes_on_with(outcomes: list[tuple[int, Failure | None]],
                                         pick: int | None) -> None:
    race = Race(Account(0), 1, 1)
    assert race.fire()
    got = None
    for which, failure in outcomes:
        got = race.heard(which, failure)
    assert got == pick


def test_without_a_hedge_the_first_try_is_all_there_is() -> None:
    race = Race(Account(0), 1, 1)
    assert race.heard(FIRST, RETRY) == FIRST
    assert not Race(Account(0), 1, 0).fire()  # nothing reserved: no hedge
    assert wins(None) and wins(FATAL) and not wins(DNR)


@pytest.mark.parametrize(("fired", "outcomes", "pick", "held", "left"), [
    (False, [(FIRST, OK)], FIRST, 1, 1),  # the reserve goes back; the loop settles the 1 held
    (True, [(FIRST, OK)], FIRST, 1, 0),  # the reserve was the hedge's cost
    (True, [(HEDGE, OK)], HEDGE, 0, 0),  # the first, cancelled, forfeits what it held
    (True, [(FIRST, RETRY), (HEDGE, OK)], HEDGE, 0, 1),  # its reply gave back 1
    (True, [(FIRST, Failure(True, None, REFUSED)), (HEDGE, OK)], HEDGE, 0, 1),  # never sent
    (True, [(FIRST, TIMEOUT), (HEDGE, OK)], HEDGE, 0, 0),  # lost: fail closed
    (True, [(FIRST, RETRY), (HEDGE, DNR)], HEDGE, 0, 1),
])
def test_what_is_settled_and_what_is_still_held(fired: bool,
                                                outcomes: list[tuple[int, Failure | None]],
                                                pick: int, held: int, left: int) -> None:
    account = Account(2)  # budget 2: one reserved for the hedge, one forwarded with the first
    reserved = account.hold(1)
    race = Race(account, account.hold(1), reserved)
    assert account.left == 0
    if fired:
        race.fire()
    for which, failure in outcomes:
        got = race.heard(which, failure)
    assert got == pick
    assert (race.settle(pick), account.left) == (held, left)


outcome = st.sampled_from([OK, RETRY, DNR, FATAL, TIMEOUT, Failure(True, Reply(0), ANSWERED)])


@given(budget=st.integers(1, 5), fired=st.booleans(), first=outcome, hedge=outcome,
       hedge_first=st.booleans())
def test_a_race_never_gives_back_more_than_was_held(budget: int, fired: bool,
                                                    first: Failure | None, hedge: Failure | None,
                                                    hedge_first: bool) -> None:
    """Two tries cost at most 1 + what was forwarded: the reserve and the forwarded budget come
    back only as the replies say, and never beyond the budget."""
    account = Account(budget)
    reserved = account.hold(1)
    held = account.hold(account.left)
    race = Race(account, held, reserved)
    if fired:
        race.fire()
    order = [(HEDGE, hedge), (FIRST, first)] if hedge_first else [(FIRST, first), (HEDGE, hedge)]
    pick = None
    for which, failure in order:
        if which == HEDGE and not fired:
            continue
        pick = race.heard(which, failure)
        if pick is not None:
            break
    assert pick is not None
    still = race.settle(pick)
    assert 0 <= account.left + still <= budget - (1 if fired else 0)
    assert still <= held
