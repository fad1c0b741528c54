"""The one loop with an admission controller: a shed attempt gives up without being made, frees a
breaker's probe slot, and a made attempt's verdict reaches the controller."""

from __future__ import annotations

from typing import Any

import pytest

from askonce._loop import ATTEMPT, IO, Tried, keep, steps
from askonce.core.admission import Admission, AdmissionPolicy
from askonce.core.backoff import NO_WAIT
from askonce.core.breaker import Breaker, BreakerPolicy, State
from askonce.core.question import Account, Tab
from askonce.core.retry import ANSWERED, Failure, RetryPolicy, RetryState, Why
from askonce.core.wire import Reply
from askonce.errors import CircuitOpen, error_for

FAILED = Tried(Failure(True, None, ANSWERED), False, None, ANSWERED)


def _dead() -> Admission:
    """An admission whose window holds 100 failures: it sheds 99 % of attempts."""
    a = Admission(AdmissionPolicy())
    for _ in range(100):
        a.admit(0.0, 0.999)
        a.record(0.0, success=False)
    return a


def _run(admission: Admission, outcomes: list[Tried], u: float,
         breaker: Breaker | None = None) -> tuple[int, Any]:
    """Drive the loop at t = 1 with the draw ``u``; (attempts made, the loop's end)."""
    state = RetryState(RetryPolicy(attempts=3, backoff=NO_WAIT, deadline=None),
                       Tab("k", "client", True, Account(2), None), "layer", False)
    loop = steps(state, clock=lambda: 1.0, random=lambda: u, breaker=breaker, end=keep,
                 admission=admission)
    made, value = 0, None
    try:
        while True:
            kind, what = loop.send(value)
            if kind is ATTEMPT:
                value = outcomes[made]
                made += 1
            elif kind is IO:
                value = what()
            else:
                value = None
    except StopIteration as stop:
        return made, stop.value


def test_a_shed_attempt_is_never_made_and_says_do_not_retry() -> None:
    made, (ok, reply) = _run(_dead(), [], u=0.5)
    assert made == 0 and not ok
    assert reply.dnr and reply.reason == "shed"


def test_an_admitted_attempt_is_made_and_its_verdict_counted() -> None:
    a = _dead()
    made, (ok, _) = _run(a, [FAILED, Tried(None, True)], u=0.995)  # above p = 0.99: admitted
    assert made == 2 and ok
    assert (a.calls, a.successes) == (102, 1)


@pytest.mark.parametrize("u", [0.5, 0.995])
def test_a_shed_probe_frees_the_breakers_slot(u: float) -> None:
    breaker = Breaker(BreakerPolicy(open_for=0.5, half_open_probes=1))
    breaker.force_open(0.0)
    assert breaker.state_at(1.0) is State.HALF_OPEN
    made, _ = _run(_dead(), [Tried(None, True)], u=u, breaker=breaker)
    if u < 0.99:  # shed: the half-open slot is free again for the next caller
        assert made == 0 and breaker.snapshot()["probes_admitted"] == 0
        assert breaker.allow(1.0)
    else:  # admitted: the probe was made and closed the breaker
        assert made == 1 and breaker.state is State.CLOSED


def test_the_shed_give_up_is_its_own_kind_raised_as_circuit_open() -> None:
    state = RetryState(RetryPolicy(deadline=None), Tab("k", "client", True, Account(2), None),
                       "layer", False)
    give_up = state.refused()
    assert give_up.kind is Why.SHED and give_up.reply == Reply(2, True, "shed")
    err = error_for(give_up, None, layer="layer", key="k", attempts=0)
    assert isinstance(err, CircuitOpen) and "shed" in str(err) and "breaker" not in str(err)


@pytest.mark.parametrize("kept", [None, False])
def test_a_retry_shed_after_a_discarded_response_does_not_return_it(kept: bool | None) -> None:
    # The first attempt is admitted and fails with a response, which is discarded before the retry;
    # the retry is shed. A response released by the discard (None) is gone: the give-up must not
    # return it. One the discard left whole (False: nothing to release, as gRPC's) still is.
    state = RetryState(RetryPolicy(attempts=3, backoff=NO_WAIT, deadline=None),
                       Tab("k", "client", True, Account(2), None), "layer", False)
    draws = iter([0.995, 0.0, 0.5])  # admitted, the backoff's jitter, shed
    ended: list[Tried | None] = []
    discarded: list[object] = []

    def end(state: RetryState, action: Any, last: Tried | None, retry_at: float | None) -> None:
        ended.append(last)

    def discard(response: object) -> bool | None:
        discarded.append(response)
        return kept

    loop = steps(state, clock=lambda: 1.0, random=lambda: next(draws), end=end, admission=_dead(),
                 discard=discard)
    failed = FAILED._replace(response="503")
    value: Any = None
    with pytest.raises(StopIteration) as stop:
        while True:
            kind, what = loop.send(value)
            value = failed if kind is ATTEMPT else what() if kind is IO else None
    assert stop.value.value[1].reason == "shed" and discarded == ["503"]
    (last,) = ended
    assert last is not None and last.response == (None if kept is None else "503")
