"""The retry state machine, transition by transition, with an injected clock and random draw; its policy
refuses at construction what it would misread."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

from askonce.core.backoff import NO_WAIT, Backoff
from askonce.core.question import Account, Hop, Tab, mint_key
from askonce.core.retry import ANSWERED, LOST, REFUSED, Acquire, Attempt, Failure, GiveUp, RetryPolicy, RetryState, Wait
from askonce.core.wire import Reply

KEY = mint_key(0, bytes(16))


def make(budget: int = 2, deadline: float | None = None, **policy: object) -> RetryState:
    tab = Tab(KEY, "edge", True, Account(budget), deadline)
    return RetryState(RetryPolicy(**policy), tab, "svc")  # type: ignore[arg-type]


def test_first_attempt_carries_the_layer_hop() -> None:
    assert make().start(0.0) == Attempt(1, Hop("svc", 1))


def test_no_first_attempt_after_the_deadline() -> None:
    action = make(deadline=5.0).start(5.0)
    assert isinstance(action, GiveUp) and action.kind == "deadline" and action.reply.dnr


def test_a_retry_spends_one_at_once_and_waits_the_jittered_backoff() -> None:
    state = make(budget=2, backoff=Backoff(base=1.0, cap=10.0))
    action = state.on_failure(Failure(), now=0.0, u=0.5)
    assert action == Wait(0.5)
    assert state.tab.account.left == 1  # visible to siblings before the wait
    assert state.resume(0.5) == Attempt(2, Hop("svc", 2))
    assert state.on_failure(Failure(), now=1.0, u=0.5) == Wait(1.0)  # ceiling doubled


@pytest.mark.parametrize(
    ("budget", "deadline", "policy", "failure", "now", "kind", "dnr", "reason"),
    [
        (2, None, {}, Failure(retryable=False), 0.0, "not-retryable", False, None),
        (0, None, {}, Failure(), 0.0, "exhausted", True, "exhausted"),
        (2, 1.0, {}, Failure(), 1.0, "deadline", True, "deadline"),
        (2, None, {}, Failure(reply=Reply(1, True, "overloaded", 0.2)), 0.0, "dnr", True, "overloaded"),
        (2, None, {"max_pushback": 1.0}, Failure(retry_after=5.0), 0.0, "pushback", True, "overloaded"),
        (2, None, {"attempts": 1}, Failure(), 0.0, "attempts", False, None),
        (2, None, {"idempotent": False}, Failure(delivery=ANSWERED, reply=Reply(2)), 0.0, "not-idempotent", False,
         None),
        (2, None, {"idempotent": False}, Failure(), 0.0, "not-idempotent", False, None),
        # a wait that would end past the deadline is not started
        (2, 1.0, {"backoff": Backoff(base=2.0, cap=2.0, jitter=False)}, Failure(), 0.0, "deadline", True, "deadline"),
        # a not-retryable failure still passes on a callee's do-not-retry
        (2, None, {}, Failure(retryable=False, reply=Reply(0, True, "cap")), 0.0, "not-retryable", True, "cap"),
    ],
)
def test_give_up_table(budget: int, deadline: float | None, policy: dict[str, object], failure: Failure,
                       now: float, kind: str, dnr: bool, reason: str | None) -> None:
    action = make(budget, deadline, **policy).on_failure(failure, now=now, u=0.0)
    assert isinstance(action, GiveUp)
    assert (action.kind, action.reply.dnr, action.reply.reason) == (kind, dnr, reason)


@pytest.mark.parametrize(("delivery", "reply", "left_after", "kind"), [
    (REFUSED, None, 1, None),           # never reached: all held comes back, one retry spent
    (ANSWERED, None, 1, None),          # a callee that says nothing spent nothing of ours
    (ANSWERED, Reply(1), 0, None),      # the callee left 1: it comes back and pays for our retry
    (ANSWERED, Reply(9), 1, None),      # a reply can return no more than was held
    (ANSWERED, Reply(0), 0, "exhausted"),
    (LOST, None, 0, "exhausted"),        # fail closed: sent, no response, the callee may have spent it all
])
def test_held_budget_is_settled_by_the_delivery(delivery: str, reply: Reply | None, left_after: int,
                                                kind: str | None) -> None:
    state = make(budget=2)
    assert state.forward() == 2 and state.tab.account.left == 0  # held in escrow while the call is out
    action = state.on_failure(Failure(delivery=delivery, reply=reply), now=0.0, u=0.0)
    if kind is None:
        assert action == Wait(0.0)
    else:
        assert isinstance(action, GiveUp) and action.kind == kind
    assert state.tab.account.left == left_after


def test_a_request_that_never_reached_the_callee_may_be_retried_even_if_not_idempotent() -> None:
    state = make(budget=2, idempotent=False)
    state.forward()
    assert state.on_failure(Failure(delivery=REFUSED), now=0.0, u=0.0) == Wait(0.0)
    assert state.tab.account.left == 1  # only our own retry was spent


def test_concurrent_forwards_do_not_double_spend() -> None:
    tab = Tab(KEY, "edge", True, Account(2), None)
    a, b = RetryState(RetryPolicy(), tab, "a"), RetryState(RetryPolicy(), tab, "b")
    assert (a.forward(), b.forward()) == (2, 0)


def test_unknown_delivery_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        Failure(delivery="maybe")


def test_pushback_lengthens_the_wait() -> None:
    state = make(backoff=NO_WAIT)
    assert state.on_failure(Failure(reply=Reply(2, pushback=0.7)), now=0.0, u=0.0) == Wait(0.7)
    assert make(backoff=NO_WAIT).on_failure(Failure(retry_after=1.5), now=0.0, u=0.0) == Wait(1.5)


def test_throttled_when_the_bucket_has_no_token() -> None:
    tab = Tab(KEY, "edge", True, Account(2), None)
    state = RetryState(RetryPolicy(backoff=NO_WAIT), tab, "svc", bucket=True)
    assert isinstance(state.on_failure(Failure(), now=0.0, u=0.0), Acquire)
    action = state.acquired(False, now=0.0)
    assert isinstance(action, GiveUp) and action.kind == "throttled" and action.reply.dnr
    assert tab.account.left == 2  # a throttled retry spends nothing


def test_a_granted_token_leads_to_the_wait() -> None:
    tab = Tab(KEY, "edge", True, Account(2), None)
    state = RetryState(RetryPolicy(backoff=NO_WAIT), tab, "svc", bucket=True)
    state.on_failure(Failure(), now=0.0, u=0.0)
    assert state.acquired(True, now=0.0) == Wait(0.0) and tab.account.left == 1


def test_breaker_open_tells_the_caller_when_to_come_back() -> None:
    action = make().breaker_open(now=10.0, retry_at=12.5)
    assert action.kind == "breaker-open" and action.reply.dnr and action.reply.pushback == 2.5


def test_deadline_passing_during_the_wait_stops_the_next_attempt() -> None:
    state = make(deadline=1.0, backoff=Backoff(base=0.5, cap=0.5, jitter=False))
    assert state.on_failure(Failure(), now=0.0, u=0.0) == Wait(0.5)
    action = state.resume(1.2)
    assert isinstance(action, GiveUp) and action.kind == "deadline"


@pytest.mark.parametrize(("budget", "reply", "left"), [
    (2, Reply(1), 1), (2, Reply(5), 2), (2, None, 2), (2, Reply(math.nan), 2),  # type: ignore[arg-type]
    (2.0, Reply(1.0), 1.0), (2.0, Reply(2.0), 2.0), (70, Reply(70), 70)])  # type: ignore[arg-type]
def test_on_success_gives_back_the_least_of_what_was_held_and_what_the_reply_says(
        budget: Any, reply: Reply | None, left: float) -> None:
    # min(held, reply.budget), whatever numbers a hand-built account or reply carries
    state = make(budget=budget)
    state.forward()
    assert state.on_success(reply) == Reply(left) and state.tab.account.left == left


def test_on_success_settles_what_the_callee_spent() -> None:
    state = make(budget=3)
    state.forward()
    assert state.on_success(Reply(1)).budget == 1 and state.tab.account.left == 1


@pytest.mark.parametrize("bad", [{"attempts": 0}, {"attempts": 1001}, {"budget": -1}, {"deadline": 0},
                                 {"deadline": -1.0}, {"min_attempt": -1}, {"max_pushback": -1}])
def test_policy_validation(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(("pushback", "retry_after", "expect"), [
    (float("nan"), None, None), (0.5, float("nan"), 0.5),
    (61.0, None, 60.0),  # passed upward as this layer's own max_pushback, never more
])
def test_a_pushback_beyond_max_or_unreadable_ends_the_question_instead_of_waiting(
        pushback: float, retry_after: float | None, expect: float | None) -> None:
    # max(nan, x) is nan or x depending on the order: either way no Wait(nan) may come out
    state = make(budget=2, backoff=NO_WAIT, max_pushback=60.0)
    action = state.on_failure(Failure(reply=Reply(2, False, None, pushback), retry_after=retry_after), now=0.0, u=0.5)
    if expect == 0.5:  # a NaN Retry-After beside a readable pushback: max() keeps the pushback
        assert action == Wait(0.5)
        return
    assert isinstance(action, GiveUp) and action.kind == "pushback" and action.reply.dnr
    assert action.reply.pushback == expect
    assert state.tab.account.left == 2  # nothing was spent on a retry that never happens


@pytest.mark.parametrize("pushback", [61.0, 1e6, 86_400.0])
def test_a_do_not_retry_passes_its_pushback_upward_clamped_to_max_pushback(pushback: float) -> None:
    state = make(budget=2, backoff=NO_WAIT, max_pushback=60.0)
    action = state.on_failure(Failure(reply=Reply(1, True, "overloaded", pushback)), now=0.0, u=0.5)
    assert isinstance(action, GiveUp) and action.reply.dnr and action.reply.reason == "overloaded"
    assert action.reply.pushback == 60.0


def test_a_do_not_retry_with_an_unreadable_pushback_passes_no_wait_upward() -> None:
    # NaN is no wait anybody can tell (as for this layer's own pushback give-up), not max_pushback.
    state = make(budget=2, backoff=NO_WAIT, max_pushback=60.0)
    nan = float("nan")
    action = state.on_failure(Failure(reply=Reply(1, True, "overloaded", nan)), now=0.0, u=0.5)
    assert isinstance(action, GiveUp) and action.reply.dnr and action.reply.reason == "overloaded"
    assert action.reply.pushback is None


def test_an_attempt_never_sent_gives_back_what_forward_held() -> None:
    state = make(budget=3)
    assert state.forward() == 3 and state.tab.account.left == 0
    state.unsent()
    assert state.tab.account.left == 3 and state.held == 0
    state.unsent()  # twice: nothing more comes back
    assert state.tab.account.left == 3


# --- the policy refuses at construction what it would misread -----------------------------------------------


MISCONFIGURED: list[Any] = [
    pytest.param(lambda: RetryPolicy(attempts="3"), id="RetryPolicy attempts str (TypeError)"),  # type: ignore[arg-type]
    pytest.param(lambda: RetryPolicy(attempts=2.5), id="RetryPolicy attempts float"),  # type: ignore[arg-type]
    pytest.param(lambda: RetryPolicy(budget=1.5), id="RetryPolicy budget float"),  # type: ignore[arg-type]
]


@pytest.mark.parametrize("make", MISCONFIGURED)
def test_a_misconfiguration_is_refused_at_construction(make: Callable[[], object]) -> None:
    with pytest.raises(ValueError):
        make()


NAMED: list[Any] = [
    pytest.param(lambda: RetryPolicy(attempts=True), id="RetryPolicy attempts bool"),
    pytest.param(lambda: RetryPolicy(budget="2"), id="RetryPolicy budget str"),  # type: ignore[arg-type]
    pytest.param(lambda: RetryPolicy(idempotent="no"), id="RetryPolicy idempotent str"),  # type: ignore[arg-type]
    pytest.param(lambda: RetryPolicy(backoff=None), id="RetryPolicy backoff None"),  # type: ignore[arg-type]
    pytest.param(lambda: RetryPolicy(deadline=True), id="RetryPolicy deadline bool"),
    pytest.param(lambda: RetryPolicy(min_attempt="1"), id="RetryPolicy min_attempt str"),  # type: ignore[arg-type]
    pytest.param(lambda: RetryPolicy(max_pushback=math.nan), id="RetryPolicy max_pushback nan"),
]


@pytest.mark.parametrize("make", NAMED)
def test_a_misconfiguration_is_a_value_error_naming_the_value(make: Any) -> None:
    with pytest.raises(ValueError, match=r"got|not a single"):
        make()


# --- a timed-out try to a callee that joins: the retry re-attaches to the work in flight ----------

JOINABLE = Failure(delivery=LOST, joinable=True)


def test_a_lost_try_to_a_callee_that_joins_keeps_what_it_forwarded_and_rejoins() -> None:
    state = make(budget=3, backoff=Backoff(base=1.0, cap=10.0))
    assert state.forward() == 3 and state.tab.account.left == 0
    assert state.on_failure(JOINABLE, now=0.0, u=0.5) == Wait(0.5)  # no budget left, still a retry
    assert state.rejoin and state.held == 2  # the re-attach's arrival is paid out of what is held
    assert state.resume(0.5) == Attempt(2, Hop("svc", 2))
    assert state.forward() == 2  # forwarded again with the re-attach, not held twice
    state.on_success(Reply(2))  # the run spent nothing of its own
    assert state.tab.account.left == 2 and not state.rejoin


def test_a_rejoined_answer_returns_no_more_than_is_held() -> None:
    state = make(budget=3)
    state.forward()
    state.on_failure(JOINABLE, now=0.0, u=0.0)
    state.on_success(Reply(3))  # a callee claiming more than it was sent
    assert state.tab.account.left == 2


@pytest.mark.parametrize("failure", [Failure(delivery=REFUSED), Failure(delivery=LOST)])
def test_a_refused_or_lost_reattach_forfeits_what_is_held(failure: Failure) -> None:
    state = make(budget=3, attempts=5)
    state.forward()
    state.on_failure(JOINABLE, now=0.0, u=0.0)
    state.resume(0.0)
    action = state.on_failure(failure, now=0.0, u=0.0)  # the first try's work may have spent it
    assert isinstance(action, GiveUp) and action.kind == "exhausted"
    assert state.tab.account.left == 0 and state.held == 0


def test_a_failed_answer_to_a_reattach_settles_and_retries_as_usual() -> None:
    state = make(budget=3, attempts=5)
    state.forward()
    state.on_failure(JOINABLE, now=0.0, u=0.0)
    state.resume(0.0)
    state.forward()
    action = state.on_failure(Failure(reply=Reply(2), delivery=ANSWERED), now=0.0, u=0.0)
    assert action == Wait(0.0) and not state.rejoin
    assert state.tab.account.left == 1  # 2 came back, one spent on this retry


@pytest.mark.parametrize(("budget", "attempts", "deadline", "now", "kind"), [
    (0, 3, None, 0.0, "exhausted"),  # nothing held: the re-attach could not be paid
    (3, 1, None, 0.0, "attempts"),
    (3, 3, 1.0, 1.0, "deadline"),
])
def test_a_reattach_that_cannot_be_made_forfeits_what_is_held(
        budget: int, attempts: int, deadline: float | None, now: float, kind: str) -> None:
    state = make(budget=budget, attempts=attempts, deadline=deadline)
    state.forward()
    action = state.on_failure(JOINABLE, now=now, u=0.0)
    assert isinstance(action, GiveUp) and action.kind == kind
    assert state.tab.account.left == 0 and state.held == 0 and not state.rejoin


def test_an_unsafe_call_rejoins_a_callee_that_joins_but_is_not_retried_otherwise() -> None:
    state = make(budget=3, idempotent=False)
    state.forward()
    assert state.on_failure(JOINABLE, now=0.0, u=0.0) == Wait(0.0)
    other = make(budget=3, idempotent=False)
    other.forward()
    action = other.on_failure(Failure(delivery=LOST), now=0.0, u=0.0)
    assert isinstance(action, GiveUp) and action.kind == "not-idempotent"


def test_a_callee_that_joins_is_given_the_question_s_time_not_the_attempt_s() -> None:
    from askonce.core.retry import attempt_window

    assert attempt_window(1.0, 0.0, 10.0, 2.0, joins=True) == (8.0, None)
    assert attempt_window(1.0, 0.0, None, 2.0, joins=True) == (None, None)
    assert attempt_window(1.0, 0.0, 10.0, 2.0) == (1.0, None)
