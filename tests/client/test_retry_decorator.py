"""@askonce.retry, as a decorator and as an iterator, inside askonce.question: nested layers, deadlines, the
token bucket and the breaker, in one process, sync and async; what it retries and what it decorates."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

import askonce
from askonce.core.backoff import NO_WAIT
from askonce.core.question import Hop


class Target:
    def __init__(self, fail_first: int = 10**9, exc: type[BaseException] = ConnectionError) -> None:
        self.calls = 0
        self.fail_first = fail_first
        self.exc = exc
        self.keys: list[str | None] = []
        self.paths: list[tuple[Hop, ...]] = []

    def __call__(self) -> str:
        self.calls += 1
        q = askonce.current()
        self.keys.append(None if q is None else q.key)
        self.paths.append(() if q is None else q.path)
        if self.calls <= self.fail_first:
            raise self.exc("down")
        return "ok"


def layer(name: str, inner, attempts: int = 3, **kw):  # type: ignore[no-untyped-def]
    return askonce.retry(on=ConnectionError, attempts=attempts, layer=name, backoff=NO_WAIT, bucket=None, **kw)(inner)


def naive(inner, attempts: int = 3):  # type: ignore[no-untyped-def]
    def call():  # type: ignore[no-untyped-def]
        for i in range(attempts):
            try:
                return inner()
            except ConnectionError:
                if i == attempts - 1:
                    raise
    return call


def test_three_nested_layers_cost_one_plus_budget_where_plain_loops_cost_27() -> None:
    plain = Target()
    with pytest.raises(ConnectionError):
        naive(naive(naive(plain)))()
    assert plain.calls == 27

    target = Target()
    stack = layer("l1", layer("l2", layer("l3", target)))
    with askonce.question(budget=2), pytest.raises(askonce.BudgetExhausted) as info:
        stack()
    assert target.calls == 3
    assert isinstance(info.value.__cause__, ConnectionError)
    assert info.value.askonce_reply.dnr and info.value.askonce_reply.reason == "exhausted"
    assert len(set(target.keys)) == 1  # one question key on every attempt


def test_the_innermost_layer_retries_and_the_path_says_so() -> None:
    target = Target(fail_first=2)
    stack = layer("l1", layer("l2", layer("l3", target)))
    with askonce.question(budget=2):
        assert stack() == "ok"
    assert [tuple(map(str, p)) for p in target.paths] == [
        ("l1:1", "l2:1", "l3:1"), ("l1:1", "l2:1", "l3:2"), ("l1:1", "l2:1", "l3:3")]


def test_without_a_bound_question_the_outer_layer_mints_one_for_the_inner_layers() -> None:
    target = Target()
    stack = layer("l1", layer("l2", target), budget=1)
    with pytest.raises(askonce.BudgetExhausted):
        stack()
    assert target.calls == 2
    assert len(set(target.keys)) == 1


def test_layer_attempt_limit_reraises_the_original_error_with_the_reply_attached() -> None:
    target = Target()
    with askonce.question(budget=10), pytest.raises(ConnectionError) as info:
        layer("only", target, attempts=2)()
    assert target.calls == 2
    assert info.value.askonce_reply.budget == 9  # type: ignore[attr-defined]


def test_errors_not_named_in_on_are_not_retried() -> None:
    target = Target(exc=KeyError)
    with askonce.question(budget=5), pytest.raises(KeyError):
        layer("x", target)()
    assert target.calls == 1


def test_predicate_on() -> None:
    target = Target(fail_first=1, exc=ValueError)
    fn = askonce.retry(on=lambda e: isinstance(e, ValueError), backoff=NO_WAIT, bucket=None)(target)
    with askonce.question(budget=2):
        assert fn() == "ok"
    assert target.calls == 2


def test_deadline_stops_retries_and_says_so() -> None:
    now = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    target = Target()
    fn = askonce.retry(on=ConnectionError, attempts=10, backoff=askonce.Backoff(base=1.0, cap=1.0, jitter=False),
                       budget=9, deadline=2.5, clock=lambda: now[0], sleep=sleep, bucket=None)(target)
    with pytest.raises(askonce.DeadlineExceeded):
        fn()
    # attempts at 0, 1 and 2 s; a fourth would start at 3 s, past the 2.5 s deadline, so it is not waited for
    assert target.calls == 3 and slept == [1.0, 1.0]


def test_a_zero_wait_never_calls_sleep() -> None:
    def sleep(s: float) -> None:
        raise AssertionError("slept")

    target = Target(fail_first=2)
    fn = askonce.retry(on=ConnectionError, backoff=NO_WAIT, sleep=sleep, bucket=None)(target)
    with askonce.question(budget=2):
        assert fn() == "ok"


def test_token_bucket_throttles_retries_per_target() -> None:
    policy = askonce.BucketPolicy(ratio=0.0, floor=1.0, max_tokens=0)
    fn = askonce.retry(on=ConnectionError, backoff=NO_WAIT, bucket=policy, target="bucket-test",
                       clock=lambda: 0.0)(Target())
    with askonce.question(budget=5), pytest.raises(askonce.RetryThrottled) as info:
        fn()  # one floor token: one retry, then throttled
    assert info.value.attempts == 2
    with askonce.question(budget=5), pytest.raises(askonce.RetryThrottled):
        fn()


class EveryThird:
    """Fails the first two attempts of every call: a target that needs every retry it is given."""

    def __init__(self) -> None:
        self.attempts = 0

    def __call__(self) -> str:
        self.attempts += 1
        if self.attempts % 3:
            raise ConnectionError("half down")
        return "ok"


def test_the_default_protection_throttles_no_retry_a_half_working_target_needs() -> None:
    # No clock moves: a bucket's 10/s floor could not refill; admission sees 1 in 3 answered.
    target = EveryThird()
    fn = askonce.retry(on=ConnectionError, backoff=NO_WAIT, target="every-third",
                       clock=lambda: 0.0)(target)
    answered = 0
    for _ in range(300):
        with askonce.question(budget=2):
            answered += fn() == "ok"
    assert answered == 300 and target.attempts == 900  # what a plain loop of 3 answers
    given = askonce.retry(on=ConnectionError, backoff=NO_WAIT, target="every-third-bucket",
                          clock=lambda: 0.0, bucket=askonce.BucketPolicy())(EveryThird())
    throttled = 0
    for _ in range(300):
        with askonce.question(budget=2), contextlib.suppress(askonce.RetryThrottled):
            given()
            continue
        throttled += 1
    assert throttled > 150  # a bucket, when one is given, caps retries near 20 % of calls


def test_inner_give_up_is_passed_on_unchanged_even_if_outer_retries_everything() -> None:
    target = Target()
    inner = layer("inner", target)
    outer = askonce.retry(on=Exception, layer="outer", backoff=NO_WAIT, bucket=None)(inner)
    with askonce.question(budget=2), pytest.raises(askonce.BudgetExhausted) as info:
        outer()
    assert info.value.layer == "inner" and target.calls == 3


def test_fanout_children_have_derived_keys_and_share_the_budget() -> None:
    target = Target()
    a = layer("a", target)
    with askonce.question(budget=2) as q:
        with askonce.fanout("x") as x1, pytest.raises(askonce.GaveUp):
            a()
        with askonce.fanout("x") as x2, pytest.raises(askonce.GaveUp):
            a()
    assert x1.key == x2.key != q.key
    assert target.calls == 4  # 3 for the first child (budget 2), then 1: the budget is shared


def test_iterator_form() -> None:
    target = Target(fail_first=2)
    with askonce.question(budget=2):
        for attempt in askonce.retry(on=ConnectionError, layer="blk", backoff=NO_WAIT, bucket=None):
            with attempt:
                target()
    assert target.calls == 3
    assert [str(p[-1]) for p in target.paths] == ["blk:1", "blk:2", "blk:3"]


def test_iterator_form_gives_up_visibly() -> None:
    target = Target()
    with askonce.question(budget=1), pytest.raises(askonce.BudgetExhausted):
        for attempt in askonce.retry(on=ConnectionError, backoff=NO_WAIT, bucket=None):
            with attempt:
                target()
    assert target.calls == 2


async def test_async_layers_nest_like_sync_ones() -> None:
    calls = 0

    async def target() -> str:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0)
        raise ConnectionError("down")

    def alayer(name: str, inner):  # type: ignore[no-untyped-def]
        return askonce.retry(on=ConnectionError, layer=name, backoff=NO_WAIT, bucket=None)(inner)

    stack = alayer("a1", alayer("a2", alayer("a3", target)))
    async with askonce.question(budget=2):
        with pytest.raises(askonce.BudgetExhausted):
            await stack()
    assert calls == 3


async def test_async_iterator_form_and_sibling_tasks_share_the_budget() -> None:
    calls = 0

    async def sibling() -> None:
        nonlocal calls
        async for attempt in askonce.retry(on=ConnectionError, backoff=askonce.Backoff(base=0.001, cap=0.001),
                                           bucket=None):
            with attempt:
                calls += 1
                await asyncio.sleep(0)
                raise ConnectionError

    async with askonce.question(budget=3):
        results = await asyncio.gather(*(sibling() for _ in range(4)), return_exceptions=True)
    assert all(isinstance(r, askonce.GaveUp) for r in results)
    assert calls == 4 + 3  # four first attempts, three retries in all


def test_threads_spend_one_budget_atomically() -> None:
    calls = 0
    lock = threading.Lock()

    def target() -> None:
        nonlocal calls
        with lock:
            calls += 1
        raise ConnectionError

    fn = layer("t", target, attempts=100, admission=None)  # a dead target: admission would shed
    with askonce.question(budget=50):
        ctx = contextvars.copy_context()
        threads = [threading.Thread(target=lambda: ctx.copy().run(_swallow, fn)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert calls == 8 + 50


def _swallow(fn) -> None:  # type: ignore[no-untyped-def]
    with contextlib.suppress(Exception):
        fn()


def test_decorated_functions_keep_their_names() -> None:
    @askonce.retry()
    def fetch_user(user_id: int) -> int:
        return user_id

    assert fetch_user.__name__ == "fetch_user" and fetch_user(3) == 3


@pytest.mark.parametrize("bad", [{"attempts": 0}, {"layer": "has space"}, {"on": ()}, {"on": 3},
                                 {"budget": -2}])
def test_bad_configuration_is_a_clear_value_error(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        askonce.retry(**bad)  # type: ignore[arg-type]


def _breaker_layer(target: Target, now: list[float], **kw):  # type: ignore[no-untyped-def]
    from askonce.core.breaker import BreakerPolicy
    from askonce.stores.memory import MemoryStore

    policy = BreakerPolicy(window_size=4, minimum_calls=4, failure_rate=0.5, open_for=10.0, half_open_probes=1)
    return askonce.retry(on=ConnectionError, attempts=3, backoff=NO_WAIT, bucket=None, breaker=policy,
                         store=MemoryStore(lambda: now[0]), clock=lambda: now[0], layer="guarded", **kw)(target)


def test_breaker_opens_and_then_no_call_reaches_the_target() -> None:
    now = [0.0]
    target = Target()
    fn = _breaker_layer(target, now)
    with askonce.question(budget=5), pytest.raises(ConnectionError):
        fn()  # three failed attempts: the layer's own limit, so the original error
    with askonce.question(budget=5), pytest.raises(askonce.CircuitOpen) as info:
        fn()  # the fourth failure fills the window and opens the breaker: the retry is refused
    calls = target.calls
    assert calls == 4
    assert info.value.askonce_reply.dnr and info.value.askonce_reply.reason == "breaker-open"
    assert info.value.retry_at == 10.0 and info.value.askonce_reply.pushback == pytest.approx(10.0)
    with askonce.question(budget=5), pytest.raises(askonce.CircuitOpen):
        fn()
    assert target.calls == calls  # refused at once: the target saw nothing more


def test_breaker_probe_after_open_for_closes_it_on_success() -> None:
    now = [0.0]
    target = Target(fail_first=4)
    fn = _breaker_layer(target, now)
    with askonce.question(budget=5), pytest.raises(ConnectionError):
        fn()
    with askonce.question(budget=5), pytest.raises(askonce.CircuitOpen):
        fn()
    now[0] = 10.0
    with askonce.question(budget=5):
        assert fn() == "ok"  # the half-open probe succeeds
    with askonce.question(budget=5):
        assert fn() == "ok"


def test_errors_the_breaker_does_not_judge_release_the_probe() -> None:
    now = [0.0]
    target = Target(exc=asyncio.CancelledError)  # not an Exception: no verdict on the target
    fn = _breaker_layer(target, now)
    for _ in range(6):
        with askonce.question(budget=5), pytest.raises(asyncio.CancelledError):
            fn()
    assert target.calls == 6  # never opened


async def test_async_breaker() -> None:
    from askonce.core.breaker import BreakerPolicy
    from askonce.stores.memory import MemoryStore

    now = [0.0]
    calls = 0

    async def target() -> None:
        nonlocal calls
        calls += 1
        raise ConnectionError

    policy = BreakerPolicy(window_size=2, minimum_calls=2, failure_rate=1.0, open_for=5.0)
    fn = askonce.retry(on=ConnectionError, backoff=NO_WAIT, bucket=None, breaker=policy,
                       store=MemoryStore(lambda: now[0]), clock=lambda: now[0])(target)
    async with askonce.question(budget=5):
        with pytest.raises(askonce.CircuitOpen):
            await fn()
    assert calls == 2


def test_iterator_form_with_a_breaker() -> None:
    from askonce.core.breaker import BreakerPolicy
    from askonce.stores.memory import MemoryStore

    now = [0.0]
    target = Target()
    policy = BreakerPolicy(window_size=2, minimum_calls=2, failure_rate=1.0, open_for=5.0)
    layer_ = askonce.retry(on=ConnectionError, backoff=NO_WAIT, bucket=None, breaker=policy,
                           store=MemoryStore(lambda: now[0]), clock=lambda: now[0])
    with askonce.question(budget=5), pytest.raises(askonce.CircuitOpen):
        for attempt in layer_:
            with attempt:
                target()
    assert target.calls == 2


# --- base exceptions are never retried nor swallowed, not even by a catch-all predicate ---------------


def everything(exc: BaseException) -> bool:
    return True


@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, SystemExit, GeneratorExit, asyncio.CancelledError])
def test_a_catch_all_predicate_never_retries_a_base_exception(exc_type: type[BaseException]) -> None:
    calls = 0

    @askonce.retry(on=everything, backoff=NO_WAIT, bucket=None, attempts=5)
    def fn() -> None:
        nonlocal calls
        calls += 1
        raise exc_type()

    with pytest.raises(exc_type):
        fn()
    assert calls == 1


async def test_an_async_catch_all_predicate_never_retries_a_cancellation() -> None:
    calls = 0

    @askonce.retry(on=everything, backoff=NO_WAIT, bucket=None, attempts=5)
    async def fn() -> None:
        nonlocal calls
        calls += 1
        raise asyncio.CancelledError()

    with pytest.raises(asyncio.CancelledError):
        await fn()
    assert calls == 1


def test_the_iterator_form_lets_a_keyboard_interrupt_through() -> None:
    calls = 0
    with pytest.raises(KeyboardInterrupt):
        for attempt in askonce.retry(on=everything, backoff=NO_WAIT, bucket=None, attempts=5):
            with attempt:
                calls += 1
                raise KeyboardInterrupt
    assert calls == 1


def test_a_catch_all_predicate_still_retries_exceptions() -> None:
    calls = 0

    @askonce.retry(on=everything, backoff=NO_WAIT, bucket=None, attempts=3, budget=5)
    def fn() -> int:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise ValueError("again")
        return calls

    assert fn() == 3


# --- what it decorates: generator functions are refused, methods of every kind retried -----------------


def test_a_generator_function_is_refused_not_silently_unretried() -> None:
    def gen() -> Iterator[int]:
        yield 1
        raise ConnectionError  # no retry could resume this

    async def agen() -> AsyncIterator[int]:
        yield 1

    for fn in (gen, agen):
        with pytest.raises(ValueError, match="generator"):
            askonce.retry()(fn)  # type: ignore[call-overload]


class Client:
    def __init__(self) -> None:
        self.calls = 0

    @askonce.retry(on=ConnectionError, backoff=NO_WAIT, bucket=None, budget=5)
    def method(self, x: int) -> int:
        self.calls += 1
        if self.calls < 2:
            raise ConnectionError
        return x

    @askonce.retry(on=ConnectionError, backoff=NO_WAIT, bucket=None, budget=5)  # type: ignore[call-overload]
    @classmethod
    def made(cls, x: int) -> tuple[type, int]:
        cls.tries = getattr(cls, "tries", 0) + 1
        if cls.tries < 2:
            raise ConnectionError
        return cls, x

    @askonce.retry(on=ConnectionError, backoff=NO_WAIT, bucket=None)  # type: ignore[call-overload]
    @staticmethod
    def plain(x: int) -> int:
        return x


def test_methods_classmethods_and_staticmethods_are_retried() -> None:
    c = Client()
    assert c.method(7) == 7 and c.calls == 2
    assert Client.made(3) == (Client, 3)
    assert Client.plain(4) == 4 and c.plain(5) == 5


# --- on= names exceptions that may be retried (or is a predicate), and only a callable is decorated --------


REFUSED: list[Any] = [
    pytest.param(lambda: askonce.retry(on=int), id="retry on a type that is no exception"),
    pytest.param(lambda: askonce.retry(on=object), id="retry on object"),
    pytest.param(lambda: askonce.retry(on=KeyboardInterrupt), id="retry on KeyboardInterrupt"),
    pytest.param(lambda: askonce.retry(on=(ValueError, SystemExit)), id="retry on SystemExit in a tuple"),
    pytest.param(lambda: askonce.retry(on=BaseException), id="retry on BaseException"),
    pytest.param(lambda: askonce.retry(on=[ValueError]), id="retry on a list"),  # type: ignore[arg-type]
    pytest.param(lambda: askonce.retry(on=ValueError()), id="retry on an instance"),  # type: ignore[arg-type]
    pytest.param(lambda: askonce.retry()(5), id="retry decorating a non-callable"),  # type: ignore[call-overload]
]


@pytest.mark.parametrize("make", REFUSED)
def test_a_misconfiguration_is_refused_at_construction(make: Callable[[], object]) -> None:
    with pytest.raises(ValueError):
        make()


def test_what_on_may_be_stays_accepted() -> None:
    askonce.retry(on=Exception)
    askonce.retry(on=(ConnectionError, TimeoutError))
    askonce.retry(on=lambda e: isinstance(e, ValueError))


def test_nested_layers_only_the_inner_retries_and_its_error_reaches_the_caller() -> None:
    calls = []

    @askonce.retry(on=ConnectionError, layer="inner",
                   policy=askonce.RetryPolicy(attempts=3, backoff=askonce.Backoff(base=0.0, cap=0.0)))
    def inner() -> None:
        calls.append(1)
        raise ConnectionError("down")

    @askonce.retry(on=ConnectionError, layer="outer",
                   policy=askonce.RetryPolicy(attempts=3, backoff=askonce.Backoff(base=0.0, cap=0.0)))
    def outer() -> None:
        inner()

    with askonce.question(budget=6), pytest.raises(ConnectionError) as info:
        outer()
    assert len(calls) == 3  # the inner layer's own tries; the outer one did not retry it (one_layer)
    assert info.value.askonce_reply.reason == "retried"  # type: ignore[attr-defined]
