"""A timed-out attempt retried: the callee is given the attempt's limit minus a grace, and its answer
at that deadline (which says what it spent) is read as a timeout, not as a do-not-retry.

Real servers on 127.0.0.1: an askonce ASGI app under uvicorn whose handler takes 2 s on the first arrival
of each question and answers at once after that, and the same app without the middleware.
"""

from __future__ import annotations

import asyncio
import collections
import math
import re
from typing import Any

import httpx
import pytest
import requests
from hypothesis import given
from hypothesis import strategies as st

import askonce
from askonce import Reply, RetryPolicy
from askonce.client import ClientPolicy
from askonce.core.backoff import NO_WAIT
from askonce.core.question import Account, Tab
from askonce.core.retry import (
    ANSWERED,
    LOST,
    QUESTION_MARGIN,
    Attempt,
    Failure,
    GiveUp,
    RetryState,
    Wait,
    attempt_window,
    own_deadline,
)
from askonce.integrations.asgi import AskonceASGIMiddleware
from askonce.integrations.httpx import AskonceTransport, AsyncAskonceTransport
from e2e_services import uvicorn_running

# --- the core ---------------------------------------------------------------------------------------


def attempt_deadline(limit: float | None, grace: float, left: float | None = None) -> float | None:
    """The seconds a callee is given, the question's deadline ``left`` seconds away (``None``: none)."""
    return attempt_window(limit, grace, left, 0.0)[0]


@given(st.floats(0.001, 1000), st.floats(0, 10))
def test_the_callee_gets_the_limit_less_the_grace_and_never_less_than_nine_tenths(limit: float, grace: float) -> None:
    forwarded = attempt_deadline(limit, grace)
    assert forwarded is not None
    assert forwarded == pytest.approx(limit - min(grace, limit / 10))
    assert 0.9 * limit - 1e-9 <= forwarded <= limit
    # Where the question's own deadline sets the limit, a hop keeps back only the margin.
    assert attempt_deadline(limit, grace, limit) == pytest.approx(limit - min(grace, limit / 10, QUESTION_MARGIN))
    assert attempt_deadline(limit, grace, 2 * limit + 1) == forwarded


def test_no_limit_or_no_grace_forwards_the_limit_itself() -> None:
    assert attempt_deadline(None, 0.1) is None
    assert attempt_deadline(2.0, 0.0) == 2.0


DEADLINE = Failure(True, Reply(2, True, "deadline"), ANSWERED)


def test_an_answer_at_the_attempts_own_deadline_is_a_timeout_with_the_budget_it_reports() -> None:
    assert own_deadline(DEADLINE, 0.9, 3.0) == Failure(True, Reply(2), ANSWERED)
    assert own_deadline(DEADLINE, 0.9, None) == Failure(True, Reply(2), ANSWERED)  # no question deadline


@pytest.mark.parametrize("failure, forwarded, left", [
    (DEADLINE, 3.0, 3.0),  # the attempt gave the callee all the question had: the question's deadline
    (DEADLINE, 2.9995, 3.0),  # the same to the millisecond the header carries
    (DEADLINE, 2.98, 3.0),  # the question's deadline less the margin a hop keeps for the answer
    (DEADLINE, None, 3.0),  # no deadline was sent
    (Failure(True, Reply(2, True, "exhausted"), ANSWERED), 0.9, 3.0),  # another give-up passes on as it is
    (Failure(True, Reply(2), ANSWERED), 0.9, 3.0),  # a plain failure
    (Failure(True, None, LOST), 0.9, 3.0),  # no answer at all: still lost
])
def test_every_other_failure_is_left_alone(failure: Failure, forwarded: float | None, left: float | None) -> None:
    assert own_deadline(failure, forwarded, left) is failure


@pytest.mark.parametrize("grace, retried", [(0.1, True), (0.0, False)])
def test_the_core_reads_an_answer_at_the_attempts_deadline_as_a_timeout_only_with_a_grace(
        grace: float, retried: bool) -> None:
    tab = Tab("k", "edge", True, Account(2), 103.0)  # the question: budget 2, 3 s left at t = 100
    state = RetryState(RetryPolicy(attempts=3, backoff=NO_WAIT), tab, "edge")
    assert state.start(100.0).__class__ is Attempt
    given = state.given(1.0, grace, 100.0)  # a 1 s attempt
    assert given == pytest.approx(0.9 if grace else 1.0)
    state.forward()
    action = state.on_failure(Failure(True, Reply(2, True, "deadline"), ANSWERED), 101.0, 0.5)
    if retried:
        assert isinstance(action, Wait) and tab.account.left == 1  # the reply's 2 back, one retry spent
    else:
        assert isinstance(action, GiveUp) and action.kind == "dnr"


def test_the_grace_is_validated() -> None:
    for bad in (-0.1, 11, math.nan, math.inf, True, "0.1"):
        with pytest.raises(ValueError, match="deadline_grace"):
            ClientPolicy(deadline_grace=bad)  # type: ignore[arg-type]


# --- on real servers --------------------------------------------------------------------------------


class Slow:
    """Takes SLOW s on the first arrival of a question, answers at once after that; counts arrivals."""

    def __init__(self) -> None:
        self.arrivals: collections.Counter[str] = collections.Counter()
        self.deadlines: collections.defaultdict[str, list[int | None]] = collections.defaultdict(list)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        headers = dict(scope["headers"])
        key = headers.get(b"x-key", b"").decode()
        self.arrivals[key] += 1
        sent = re.search(rb"\bd=(\d+)", headers.get(b"askonce-question", b""))
        self.deadlines[key].append(None if sent is None else int(sent.group(1)))
        if self.arrivals[key] == 1:
            await asyncio.sleep(SLOW)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(scope="module")
def servers() -> Any:
    slow, plain = Slow(), Slow()
    with uvicorn_running(AskonceASGIMiddleware(slow, layer="svc")) as url, uvicorn_running(plain) as plain_url:
        yield slow, url, plain, plain_url


# Each try's limit, and the first arrival's time: longer than the limit. The callee's answer at its
# deadline (the limit less the grace) must reach the caller before the limit, on a loaded machine too.
ATTEMPT = 2.0
SLOW = 6.0


def policy(grace: float) -> ClientPolicy:
    return ClientPolicy(layer="edge", retry=RetryPolicy(attempts=3, backoff=NO_WAIT), attempt_timeout=ATTEMPT,
                        deadline_grace=grace, bucket=None)


def ask(mode: str, grace: float, url: str, key: str) -> tuple[int | None, int]:
    """One question (budget 2, 15 s): the status it ended with (None: raised) and the budget left."""
    def run() -> int | None:
        if mode == "requests":
            from askonce.integrations.requests import session

            with session(policy(grace)) as s:
                return s.get(url, headers={"x-key": key}).status_code
        if mode == "sync":
            with httpx.Client(transport=AskonceTransport(policy=policy(grace))) as client:
                return client.get(url, headers={"x-key": key}).status_code

        async def go() -> int:
            async with httpx.AsyncClient(transport=AsyncAskonceTransport(policy=policy(grace))) as client:
                return (await client.get(url, headers={"x-key": key})).status_code

        return asyncio.run(go())

    with askonce.question(budget=2, deadline=15.0):
        try:
            status = run()
        except (httpx.TimeoutException, requests.Timeout, askonce.GaveUp):
            status = None
        left = askonce.current()
        assert left is not None
        return status, left.budget


@pytest.mark.parametrize("mode", ["sync", "async", "requests"])
def test_with_a_grace_a_timed_out_attempt_is_retried_at_the_cost_of_one_retry(servers: Any, mode: str) -> None:
    slow, url, _, _ = servers
    key = f"grace-{mode}"
    assert ask(mode, 0.2, url, key) == (200, 1)  # the callee answered 503 deadline at 1.8 s, b=2: one retry
    assert slow.arrivals[key] == 2


@pytest.mark.parametrize("grace, sent", [(0.0, 2000), (0.2, 1800), (0.05, 1950)])
def test_the_callee_is_given_the_wait_less_the_grace(servers: Any, grace: float, sent: int) -> None:
    # Without a grace the callee's deadline and the caller's timeout are the same instant: whether its
    # answer arrives before the caller stops listening is a race, and a lost call forfeits its budget.
    slow, url, _, _ = servers
    key = f"sent-{grace}"
    ask("sync", grace, url, key)
    assert slow.deadlines[key][0] is not None and abs(slow.deadlines[key][0] - sent) <= 1


def test_a_callee_that_does_not_speak_askonce_stays_lost_even_with_a_grace(servers: Any) -> None:
    _, _, plain, plain_url = servers
    assert ask("sync", 0.2, plain_url, "plain") == (None, 0)
    assert plain.arrivals["plain"] == 1
