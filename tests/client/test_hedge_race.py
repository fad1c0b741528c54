"""Caller.acall with ClientPolicy(hedge=...), driven in process by scripted exchanges: what the
tries carry, which outcome the call goes on with, what is cancelled and discarded. Each try waits on
events the script sets, so the order of events, never their timing, decides."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

import askonce
from askonce import Reply, RetryPolicy
from askonce.client import Caller, ClientPolicy, Outcome
from askonce.core.backoff import NO_WAIT
from askonce.core.hedge import HedgePolicy
from askonce.core.retry import ANSWERED, Failure
from askonce.core.wire import Malformed, Question, parse_question


class Response:
    def __init__(self, name: str, outcome: Outcome) -> None:
        self.name, self.outcome = name, outcome

    def __repr__(self) -> str:
        return self.name


def ok(name: str, budget: int) -> Response:
    return Response(name, Outcome(None, Reply(budget), True))


def failed(name: str, budget: int, retryable: bool = True, dnr: bool = False) -> Response:
    reply = Reply(budget, dnr, "overloaded" if dnr else None)
    return Response(name, Outcome(Failure(retryable, reply, ANSWERED), reply, True))


Step = Callable[[], Awaitable[Response]]


class Scripted:
    """An AsyncExchange whose n-th try (the hedge included, in the order sent) runs
    ``script[n]``; forks share the script and the record."""

    timeout = None

    def __init__(self, script: list[Step], replayable: bool = True,
                 log: dict[str, list[Any]] | None = None) -> None:
        self.script, self.replayable = script, replayable
        self.log = log if log is not None else {"sent": [], "cancelled": [], "discarded": [],
                                                "forks": []}

    async def send(self, header: str, timeout: float | None) -> Response:
        q = parse_question(header, 0.0)
        assert not isinstance(q, Malformed)
        n = len(self.log["sent"])
        self.log["sent"].append(q)
        try:
            return await self.script[n]()
        except asyncio.CancelledError:
            self.log["cancelled"].append(n)
            raise

    def judge(self, response: Response) -> Outcome:
        return response.outcome

    def judge_error(self, error: Exception) -> Outcome | None:
        return None

    async def discard(self, response: Response) -> None:
        self.log["discarded"].append(response.name)

    def fork(self) -> Scripted | None:
        self.log["forks"].append(1)
        return Scripted(self.script, self.replayable, self.log) if self.replayable else None


def caller(**hedge: Any) -> Caller:
    return Caller(ClientPolicy(layer="web", bucket=None, admission=None,
                               retry=RetryPolicy(attempts=4, backoff=NO_WAIT),
                               hedge=HedgePolicy(delay=0.01, **hedge)))


def hops(log: dict[str, list[Any]]) -> list[tuple[str, int]]:
    sent: list[Question] = log["sent"]
    return [(str(q.path[-1]), q.budget) for q in sent]


def run(exchange: Scripted, budget: int = 3, c: Caller | None = None) -> tuple[Any, int]:
    async def main() -> tuple[Any, int]:
        with askonce.question(budget=budget):
            response = await (c or caller()).acall(exchange, target="t")
            q = askonce.current()
            assert q is not None
            return response, q.budget

    return asyncio.run(main())


def test_when_both_tries_fail_the_loop_retries_as_the_third_try() -> None:
    first_may_fail = asyncio.Event()

    async def first() -> Response:
        await first_may_fail.wait()
        return failed("first", 2)

    async def hedge() -> Response:
        first_may_fail.set()
        return failed("hedge", 0)

    async def retry() -> Response:
        return ok("retry", 1)

    exchange = Scripted([first, hedge, retry])
    response, left = run(exchange)
    assert response.name == "retry"
    # Budget 3: one reserved for the hedge, two forwarded with the first; the first's reply gave
    # them back, the retry spent one and forwarded the last.
    assert hops(exchange.log) == [("web:1", 2), ("web:2", 0), ("web:3", 1)]
    assert left == 1
    assert exchange.log["discarded"] == ["first", "hedge"] or exchange.log["discarded"] == [
        "hedge", "first"]


def test_a_hedge_that_answers_wins_and_the_first_try_is_cancelled() -> None:
    async def first() -> Response:
        await asyncio.Event().wait()  # never answers
        raise AssertionError

    async def hedge() -> Response:
        return ok("hedge", 0)

    exchange = Scripted([first, hedge])
    response, left = run(exchange)
    assert response.name == "hedge"
    assert exchange.log["cancelled"] == [0]
    assert left == 0  # the hedge's one, and the first's two forfeited: it may have spent them


def test_a_failure_no_retry_would_change_wins_and_ends_the_call() -> None:
    async def first() -> Response:
        await asyncio.Event().wait()
        raise AssertionError

    async def hedge() -> Response:
        return failed("hedge", 0, retryable=False)

    exchange = Scripted([first, hedge])
    response, _ = run(exchange)
    assert response.name == "hedge" and response.askonce_reply == Reply(0)
    assert exchange.log["cancelled"] == [0] and len(exchange.log["sent"]) == 2


def test_a_do_not_retry_waits_for_the_other_try_then_ends_the_call() -> None:
    hedge_failed = asyncio.Event()

    async def first() -> Response:
        await hedge_failed.wait()
        return failed("first", 2)

    async def hedge() -> Response:
        hedge_failed.set()
        return failed("hedge", 0, dnr=True)

    exchange = Scripted([first, hedge])
    response, left = run(exchange)
    assert len(exchange.log["sent"]) == 2  # no retry after a do-not-retry
    assert response.name == "hedge" and response.askonce_reply.dnr
    assert left == 2 and exchange.log["discarded"] == ["first"]


def test_the_first_answer_after_the_hedge_was_sent_wins_too() -> None:
    hedge_sent = asyncio.Event()

    async def first() -> Response:
        await hedge_sent.wait()
        return ok("first", 2)

    async def hedge() -> Response:
        hedge_sent.set()
        await asyncio.Event().wait()
        raise AssertionError

    exchange = Scripted([first, hedge])
    response, left = run(exchange)
    assert response.name == "first" and exchange.log["cancelled"] == [1]
    assert left == 2  # the hedge cost its one; the first's reply gave back its two


def test_cancelling_the_call_cancels_both_tries() -> None:
    async def hang() -> Response:
        await asyncio.Event().wait()
        raise AssertionError

    exchange = Scripted([hang, hang])

    async def main() -> None:
        with askonce.question(budget=2):
            task = asyncio.ensure_future(caller().acall(exchange, target="t"))
            while len(exchange.log["sent"]) < 2:
                await asyncio.sleep(0.005)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())
    assert sorted(exchange.log["cancelled"]) == [0, 1]


def test_no_hedge_for_a_body_that_cannot_be_replayed_nor_an_unsafe_call() -> None:
    async def first() -> Response:
        await asyncio.sleep(0.1)  # far past the hedge's delay
        return ok("first", 2)

    exchange = Scripted([first], replayable=False)
    assert run(exchange)[0].name == "first" and exchange.log["forks"] == [1]

    unsafe = Scripted([first])

    async def main() -> str:
        with askonce.question(budget=3):
            response = await caller().acall(unsafe, target="t", idempotent=False)
            return str(response.name)

    assert asyncio.run(main()) == "first" and unsafe.log["forks"] == []


def test_the_sync_call_never_hedges() -> None:
    class Sync:
        timeout = None
        forks = 0

        def send(self, header: str, timeout: float | None) -> Response:
            return ok("only", 2)

        def judge(self, response: Response) -> Outcome:
            return response.outcome

        def judge_error(self, error: Exception) -> Outcome | None:
            return None

        def discard(self, response: Response) -> None:
            pass

        def fork(self) -> None:
            self.forks += 1

    exchange = Sync()
    with askonce.question(budget=2):
        assert caller().call(exchange, target="t").name == "only"
    assert exchange.forks == 0


@pytest.mark.parametrize("hedge", [0.1, "yes", True])
def test_the_policy_wants_a_hedge_policy(hedge: object) -> None:
    with pytest.raises(ValueError, match=r"^hedge must be HedgePolicy"):
        ClientPolicy(hedge=hedge)  # type: ignore[arg-type]
