"""askonce.client.Caller: the shared client shell, driven against a real HTTP server on 127.0.0.1
(``http_target.py``) through the smallest possible integration, and in process through scripted exchanges."""

from __future__ import annotations

import http.client
from typing import Any

import pytest

import askonce
from askonce import Question, Reply, RetryPolicy, _context
from askonce.client import Caller, ClientPolicy, Outcome, judge_http, last_reply, replies
from askonce.core import wire
from askonce.core.backoff import NO_WAIT
from askonce.core.breaker import BreakerPolicy
from askonce.core.question import Account, Tab
from askonce.core.wire import REPLY_HEADER, format_reply
from askonce.stores.memory import MemoryStore
from http_target import StdlibExchange, Target, call, policy, refused_url

# --- the Caller against a real server -------------------------------------------------------------------


def test_a_failing_target_sees_one_plus_budget_arrivals_and_one_key(target: Target) -> None:
    p = policy(retry=RetryPolicy(attempts=10, backoff=NO_WAIT))
    for _ in range(5):
        with askonce.question(budget=2) as q:
            status, _ = call(p, target.url("/fail"))
        assert status == 503
        assert target.arrivals[q.key] == 3
    assert len(target.arrivals) == 5
    assert [tuple(map(str, s.path)) for s in target.seen[:3] if s] == [("web:1",), ("web:2",), ("web:3",)]


def test_without_a_bound_question_each_call_mints_its_own(target: Target) -> None:
    call(policy(), target.url("/ok"))
    call(policy(originator=True), target.url("/ok"))
    local, edge = target.seen
    assert local is not None and edge is not None and local.key != edge.key
    assert (local.origin, local.edge, edge.edge) == ("web", False, True)
    assert local.budget == edge.budget == 2


def test_refused_gives_up_with_the_original_error_and_spends_only_our_own_retries() -> None:
    with askonce.question(budget=5), pytest.raises(ConnectionRefusedError) as info:
        call(policy(), refused_url())
    # 5 - 2 retries, nothing held; this layer retried, so nobody above should (one_layer)
    assert info.value.askonce_reply == Reply(3, True, "retried")  # type: ignore[attr-defined]


def test_no_first_attempt_past_the_deadline(target: Target) -> None:
    now = [0.0]
    with askonce.question(budget=2, deadline=1.0):
        now[0] = 10.0 + askonce._stats.monotonic()
        with pytest.raises(askonce.DeadlineExceeded):
            call(policy(), target.url("/ok"), clock=lambda: now[0])
    assert target.total == 0


def test_an_unknown_error_while_sending_fails_closed_and_passes_through(target: Target) -> None:
    class Broken(StdlibExchange):
        def send(self, header: str, timeout: float | None) -> tuple[int, http.client.HTTPMessage]:
            super().send(header, timeout)
            raise KeyError("bug in the integration")

    p = policy()
    with askonce.question(budget=2):
        with pytest.raises(KeyError):
            Caller(p).call(Broken(p, target.url("/ok")), target="t")
        current = askonce.current()
    assert current is not None and current.budget == 0  # the callee may have spent what it was given
    assert target.total == 1


def test_the_token_bucket_throttles_retries_per_target(target: Target) -> None:
    p = policy(retry=RetryPolicy(attempts=5, backoff=NO_WAIT),
               bucket=askonce.BucketPolicy(ratio=0.0, floor=1.0, max_tokens=0))
    store = MemoryStore(lambda: 0.0)
    with askonce.question(budget=5):
        status, _ = call(p, target.url("/fail"), store=store, clock=lambda: 0.0)
    assert status == 503 and target.total == 2  # the one floor token: one retry


needs_breakers = pytest.mark.skipif(not hasattr(MemoryStore, "breaker"),
                                    reason="MemoryStore.breaker() is not there yet (added in parallel)")


@needs_breakers
def test_an_open_breaker_refuses_the_call_without_an_arrival(target: Target) -> None:
    p = policy(breaker=BreakerPolicy(window_size=2, minimum_calls=2, failure_rate=0.5, open_for=30.0))
    store = MemoryStore(lambda: 0.0)
    with askonce.question(budget=1):
        status, _ = call(p, target.url("/fail"), store=store, clock=lambda: 0.0)  # two failures: open
    assert status == 503 and target.total == 2
    with askonce.question(budget=1), pytest.raises(askonce.CircuitOpen) as info:
        call(p, target.url("/ok"), store=store, clock=lambda: 1.0)
    assert target.total == 2
    assert info.value.retry_at == 30.0 and info.value.askonce_reply.reason == "breaker-open"


def test_a_breaker_needs_a_store_that_has_breakers() -> None:
    class BucketsOnly:
        def bucket(self, target: str, policy: askonce.BucketPolicy) -> Any:
            raise AssertionError

    with pytest.raises(ValueError, match="breaker"):
        Caller(ClientPolicy(breaker=BreakerPolicy()), store=BucketsOnly())


# --- the first attempt's fast path and the general loop agree ---------------------------------------------


class Scripted:
    """An in-process exchange: each attempt answers with the next (status, reply) of a script."""

    timeout = None

    def __init__(self, p: ClientPolicy, script: list[tuple[int, Reply | None]]) -> None:
        self.policy, self.script, self.headers = p, list(script), []  # type: list[str]

    def send(self, header: str, timeout: float | None) -> tuple[int, Reply | None]:
        self.headers.append(header)
        return self.script.pop(0)

    def judge(self, response: tuple[int, Reply | None]) -> Outcome:
        status, reply = response
        return judge_http(self.policy, status, {} if reply is None else {REPLY_HEADER: format_reply(reply)})

    def judge_error(self, error: Exception) -> Outcome | None:
        return None

    def discard(self, response: object) -> None:
        pass


@needs_breakers
@pytest.mark.parametrize("script", [
    [(200, Reply(1))],                      # the callee spent one of the two forwarded
    [(200, None)],                          # a callee that says nothing spent nothing of ours
    [(503, Reply(2)), (200, Reply(2))],     # one retry, then the answer
    [(503, Reply(0, True, "exhausted"))],   # a do-not-retry passed on
    [(503, Reply(2))] * 3,                  # attempts used up
])
def test_the_fast_path_decides_as_the_general_loop_does(script: list[tuple[int, Reply | None]]) -> None:
    # A breaker sends every call through the general loop (a generator over RetryState) from the first
    # attempt; without one, the first attempt is made straight. Both must end the same way.
    outcomes = []
    for breaker in (None, BreakerPolicy(window_size=100, minimum_calls=100)):
        p = policy(breaker=breaker, retry=RetryPolicy(attempts=3, backoff=NO_WAIT))
        exchange = Scripted(p, script)
        with askonce.question(budget=3), replies():
            status, _ = Caller(p, store=MemoryStore(lambda: 0.0), clock=lambda: 0.0).call(exchange, target="t")
            left = askonce.current()
            outcomes.append((status, left.budget if left else None, last_reply(), exchange.headers))
    assert outcomes[0][:3] == outcomes[1][:3]

    def sent(headers: list[str]) -> list[tuple[int, str]]:  # what each attempt forwarded, and its path
        return [(q.budget, str(q.path[-1])) for q in (wire.parse_question(h, 0.0) for h in headers)
                if isinstance(q, Question)]

    assert sent(outcomes[0][3]) == sent(outcomes[1][3]) and len(outcomes[0][3]) == len(outcomes[1][3])


def test_an_interruption_during_the_first_attempt_fails_closed() -> None:
    import asyncio

    class Interrupted:
        timeout = None

        async def send(self, header: str, timeout: float | None) -> None:
            raise asyncio.CancelledError  # e.g. the request's task cancelled while it waits for the answer

        def judge(self, response: object) -> Outcome:
            raise AssertionError

        def judge_error(self, error: Exception) -> Outcome | None:
            raise AssertionError("a cancellation is not a transport failure")

        async def discard(self, response: object) -> None: ...

    async def go() -> askonce.Question | None:
        with askonce.question(budget=2):
            with pytest.raises(asyncio.CancelledError):
                await Caller(policy()).acall(Interrupted(), target="t")
            return askonce.current()

    left = asyncio.run(go())
    assert left is not None and left.budget == 0  # forwarded, never answered: counted as spent


# --- a call whose header cannot be built holds nothing ------------------------------------------------------


class Unsent:
    """An exchange that must never be reached: the header fails first."""

    timeout = None

    def send(self, header: str, timeout: float | None) -> object:
        raise AssertionError("sent")

    def judge(self, response: object) -> Outcome:
        raise AssertionError("judged")

    def judge_error(self, error: Exception) -> Outcome | None:
        raise AssertionError("judged")

    def discard(self, response: object) -> None:
        pass


PROBING = BreakerPolicy(open_for=1.0, half_open_probes=1)


def _minter() -> str:
    raise RuntimeError("no key today")


@pytest.mark.parametrize("policy", [
    pytest.param(ClientPolicy(bucket=None), id="first attempt (fast path)"),
    pytest.param(ClientPolicy(bucket=None, breaker=PROBING), id="general loop (breaker)"),
])
def test_a_call_whose_header_cannot_be_built_gives_back_what_it_held(policy: ClientPolicy) -> None:
    account = Account(3)
    store = MemoryStore(lambda: 0.0)
    if policy.breaker is not None:  # half-open with one probe slot: a slot not given back refuses the next call
        store.breaker("t", policy.breaker).force_open(0.0)
    caller = Caller(policy, store=store, clock=lambda: 2.0)
    # bound as a server binds it (propagation.bind would mint the key at once)
    token = _context.FRAME.set((Tab(None, "api", False, account, None, minter=_minter), ()))
    try:
        for _ in range(2):
            with pytest.raises(RuntimeError, match="no key today"):
                caller.call(Unsent(), target="t")
            if policy.breaker is not None:  # the probe's slot was handed back: the next call may probe again
                assert store.breaker("t", policy.breaker).snapshot()["probes_admitted"] == 0
    finally:
        _context.FRAME.reset(token)
    assert account.left == 3
