"""``breaker.call(fn, *args, **kwargs)``: the guard's semantics without the ``with`` protocol, sync and async.

The sync form runs on the in-memory store with an injected clock, and is checked step for step against
the guard (hypothesis); the async form runs on ``AsyncRedisStore`` against a real redis-server.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import askonce
from askonce.breakers import AsyncBreakerRegistry, BreakerRegistry, CircuitBreaker
from askonce.core.breaker import BreakerPolicy, State, Transition
from askonce.core.wire import Reply
from askonce.errors import CircuitOpen, attach_reply
from askonce.stores.aredis import AsyncRedisStore
from fake_clock import CLOSED, HALF, OPEN, POLICY, Clock
from redis_server import RedisServer


class ClientError(Exception):
    """A 4xx of the client's own: no verdict on the target (``is_failure`` says so)."""

    status_code = 404


def down() -> None:
    raise ConnectionError("down")


def not_found() -> None:
    raise ClientError()


def breaker(clock: Clock, policy: BreakerPolicy = POLICY) -> CircuitBreaker:
    return BreakerRegistry(policy=policy, clock=clock).get("svc")


def test_call_passes_arguments_and_returns_what_fn_returns() -> None:
    b = breaker(Clock())
    assert b.call(lambda a, *, k: (a, k), 1, k=2) == (1, 2)
    assert b.call(divmod, 7, 2) == (3, 1)


def test_failures_are_counted_until_the_breaker_opens_then_fn_is_not_called() -> None:
    clock = Clock()
    b = breaker(clock)
    for _ in range(4):
        with pytest.raises(ConnectionError):
            b.call(down)
    assert b.state() is OPEN
    called: list[int] = []
    with pytest.raises(CircuitOpen) as info:
        b.call(called.append, 1)
    assert called == []
    err = info.value
    assert err.retry_at == 105.0 and err.askonce_reply == Reply(0, True, "breaker-open", 5.0)
    assert isinstance(err, askonce.GaveUp)


def test_a_refusal_inside_a_question_carries_its_budget() -> None:
    clock = Clock()
    b = breaker(clock)
    b.handle.force_open(clock.now)
    clock.now += 2.0
    with askonce.question(budget=3) as q, pytest.raises(CircuitOpen) as info:
        b.call(lambda: None)
    assert info.value.askonce_reply == Reply(3, True, "breaker-open", 3.0) and info.value.key == q.key


def test_the_clients_own_errors_are_no_verdict_and_free_the_probe() -> None:
    clock = Clock()
    b = breaker(clock)
    for _ in range(8):
        with pytest.raises(ClientError):
            b.call(not_found)
    assert b.state() is CLOSED  # eight 404s: not one counted against the target
    b.handle.force_open(clock.now)
    clock.now += 5.0
    with pytest.raises(ClientError):
        b.call(not_found)  # took the only probe, said nothing about health
    assert b.call(lambda: "probe") == "probe"  # so the next call may probe
    assert b.state() is CLOSED


def test_a_custom_predicate_decides() -> None:
    b = BreakerRegistry(policy=POLICY, clock=Clock(), is_failure=lambda e: not isinstance(e, KeyError)).get("svc")
    for _ in range(8):
        with pytest.raises(KeyError):
            b.call(dict[str, int]().__getitem__, "missing")
    assert b.state() is CLOSED


def test_slow_calls_are_timed() -> None:
    clock = Clock()
    b = breaker(clock, BreakerPolicy(window_size=4, minimum_calls=2, slow_call_duration=1.0, slow_call_rate=1.0))

    def slow() -> None:
        clock.now += 1.5

    b.call(slow)
    b.call(slow)
    assert b.state() is OPEN


def test_callbacks_see_the_transitions_calls_cause() -> None:
    clock = Clock()
    reg = BreakerRegistry(policy=POLICY, clock=clock)
    seen: list[tuple[State, State, str]] = []
    reg.on_transition(lambda target, t: seen.append((t.old, t.new, t.reason)))
    for _ in range(4):
        with pytest.raises(ConnectionError):
            reg.get("svc").call(down)
    clock.now += 5.0
    reg.get("svc").call(lambda: None)
    assert seen == [(CLOSED, OPEN, "failure-rate"), (OPEN, HALF, "open-elapsed"), (HALF, CLOSED, "probes-succeeded")]


# --- the same as the guard, step for step ---------------------------------------------------------------

OUTCOMES = ["ok", "fail", "client-error", "interrupted"]


def _body(clock: Clock, outcome: str, took: float) -> Callable[[], str]:
    def fn() -> str:
        clock.now += took
        if outcome == "fail":
            raise ConnectionError("down")
        if outcome == "client-error":
            raise ClientError()
        if outcome == "interrupted":
            raise KeyboardInterrupt  # a BaseException: no verdict, as a cancellation
        return "ok"
    return fn


def _run(b: CircuitBreaker, clock: Clock, via_call: bool, outcome: str, took: float) -> tuple[Any, ...]:
    fn = _body(clock, outcome, took)
    try:
        if via_call:
            result: object = b.call(fn)
        else:
            with b.guard():
                result = fn()
    except CircuitOpen as exc:
        return ("open", exc.retry_at, exc.askonce_reply)
    except (ConnectionError, ClientError, KeyboardInterrupt) as exc:
        return ("raised", type(exc))
    return ("returned", result)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(OUTCOMES), st.sampled_from([0.0, 0.5, 2.0]),
                          st.sampled_from([0.0, 1.0, 6.0])), max_size=40))
def test_call_decides_exactly_as_the_guard(steps: list[tuple[str, float, float]]) -> None:
    policy = BreakerPolicy(window_size=6, minimum_calls=3, failure_rate=0.5, slow_call_duration=1.0,
                           slow_call_rate=0.6, open_for=5.0, half_open_probes=2)
    runs = []
    for via_call in (False, True):
        clock = Clock()
        reg = BreakerRegistry(policy=policy, clock=clock)
        transitions: list[Transition] = []
        reg.on_transition(lambda target, t, seen=transitions: seen.append(t))
        b = reg.get("svc")
        results = []
        for outcome, took, gap in steps:
            results.append((_run(b, clock, via_call, outcome, took), b.state(), b.retry_at()))
            clock.now += gap
        runs.append((results, transitions))
    assert runs[0] == runs[1]


# --- asyncio, over a real Redis ---------------------------------------------------------------------------


async def test_async_call_counts_failures_refuses_when_open_and_ignores_client_errors(
        shared_redis: RedisServer) -> None:
    store = AsyncRedisStore(shared_redis.url, op_timeout=1.0)
    reg = AsyncBreakerRegistry(store, policy=POLICY)
    try:
        async def answer(x: int, *, plus: int) -> int:
            await asyncio.sleep(0)
            return x + plus

        async def failing() -> None:
            await asyncio.sleep(0)
            raise ConnectionError("down")

        async def client_error() -> None:
            raise ClientError()

        b = reg.get(f"svc-{uuid.uuid4().hex}")
        assert await b.call(answer, 1, plus=2) == 3
        for _ in range(8):
            with pytest.raises(ClientError):
                await b.call(client_error)
        assert await b.state() is CLOSED  # no verdict, however many

        b = reg.get(f"svc-{uuid.uuid4().hex}")
        for _ in range(4):
            with pytest.raises(ConnectionError):
                await b.call(failing)
        assert await b.state() is OPEN
        called: list[int] = []

        async def record() -> None:
            called.append(1)

        with pytest.raises(CircuitOpen) as info:
            await b.call(record)
        assert called == [] and info.value.retry_at is not None and info.value.askonce_reply is not None
        assert info.value.askonce_reply.dnr and info.value.askonce_reply.reason == "breaker-open"
    finally:
        await store.aclose()


async def test_async_call_lets_a_cancellation_through_as_no_verdict(shared_redis: RedisServer) -> None:
    store = AsyncRedisStore(shared_redis.url, op_timeout=1.0)
    b = AsyncBreakerRegistry(store, policy=POLICY).get(f"svc-{uuid.uuid4().hex}")
    try:
        for _ in range(6):
            task = asyncio.create_task(b.call(asyncio.sleep, 10))
            await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert await b.state() is CLOSED
    finally:
        await store.aclose()


def test_an_overloaded_reply_counts_and_an_exhausted_one_does_not() -> None:
    def said(reason: str) -> Callable[[], None]:
        def fn() -> None:
            exc = RuntimeError("callee said")
            attach_reply(exc, Reply(0, True, reason))
            raise exc
        return fn

    exhausted, overloaded = breaker(Clock()), breaker(Clock())
    for _ in range(4):
        with pytest.raises(RuntimeError):
            exhausted.call(said("exhausted"))
        with pytest.raises(RuntimeError):
            overloaded.call(said("overloaded"))
    assert (exhausted.state(), overloaded.state()) == (CLOSED, OPEN)


def test_an_is_failure_that_raises_judges_a_failure_and_never_leaks_the_probe_slot() -> None:
    def judge(exc: BaseException) -> bool:
        raise RuntimeError("the judge is broken")

    clock = Clock()
    b = BreakerRegistry(policy=POLICY, clock=clock, is_failure=judge).get("svc")
    b.handle.force_open(clock())
    clock.now += POLICY.open_for  # half-open: one probe slot
    before = askonce.stats().get("breaker.is-failure.error", 0)

    def fails() -> None:
        raise KeyError("the call's own error")

    with pytest.raises(KeyError):  # the call's error goes through, not the judge's
        b.call(fails)
    assert askonce.stats()["breaker.is-failure.error"] == before + 1
    assert b.state() is State.OPEN  # the probe was settled as a failure: open again, not half-open for ever
