"""Every shell drives the one loop: the decorator, the iterator (``for`` and ``async for``) and the
client's ``Caller`` give the same give-up against the same Redis breaker and bucket.

The store is a real redis-server (sync ``RedisStore`` for the sync forms, ``AsyncRedisStore`` for the
async ones, whose handles must be awaited on every path); the breaker is opened for an hour, the
bucket never earns a token.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

import askonce
import askonce.breakers
from askonce import BreakerPolicy, BucketPolicy, CircuitOpen, RetryThrottled
from askonce.client import REFUSED_OUTCOME, Caller, ClientPolicy, Outcome
from askonce.stores.aredis import AsyncRedisStore
from askonce.stores.redis import RedisStore
from redis_server import RedisServer

TARGET = "dep"
OPEN = BreakerPolicy(window_size=1, minimum_calls=1, open_for=3600.0)
DRAINED = BucketPolicy(ratio=0.0, floor=0.0)


class Exchange:
    """An outgoing call whose every attempt is refused before it leaves (a transport failure)."""

    timeout = None

    def __init__(self) -> None:
        self.sent = 0

    def send(self, header: str, timeout: float | None) -> object:
        self.sent += 1
        raise ConnectionRefusedError("refused")

    def judge(self, response: object) -> Outcome:
        raise AssertionError("no response ever comes back")

    def judge_error(self, error: Exception) -> Outcome | None:
        return REFUSED_OUTCOME if isinstance(error, ConnectionError) else None

    def discard(self, response: object) -> None:
        pass


class AsyncExchange(Exchange):
    async def send(self, header: str, timeout: float | None) -> object:  # type: ignore[override]
        return super().send(header, timeout)

    async def discard(self, response: object) -> None:  # type: ignore[override]
        pass


def _retry(store: Any, **kw: Any) -> askonce.retry:
    return askonce.retry(on=ConnectionError, attempts=3, layer="api", target=TARGET, store=store,
                         sleep=lambda s: None, **kw)


def _caller(store: Any, **kw: Any) -> Caller:
    policy = ClientPolicy(layer="api", **kw)
    return Caller(policy, store=store, sleep=lambda s: None)


def sync_forms(store: RedisStore, **kw: Any) -> dict[str, Callable[[list[int]], object]]:
    def decorator(ran: list[int]) -> object:
        @_retry(store, **kw)
        def call() -> None:
            ran.append(1)
            raise ConnectionError("down")

        return call()

    def iterator(ran: list[int]) -> object:
        for attempt in _retry(store, **kw):
            with attempt:
                ran.append(1)
                raise ConnectionError("down")
        return None

    def caller(ran: list[int]) -> object:
        exchange = Exchange()
        try:
            return _caller(store, **kw).call(exchange, target=TARGET)
        finally:
            ran.extend([1] * exchange.sent)

    return {"decorator": decorator, "iterator": iterator, "caller": caller}


def async_forms(store: AsyncRedisStore,
                **kw: Any) -> dict[str, Callable[[list[int]], Awaitable[object]]]:
    async def decorator(ran: list[int]) -> object:
        @_retry(store, **kw)
        async def call() -> None:
            ran.append(1)
            raise ConnectionError("down")

        return await call()

    async def iterator(ran: list[int]) -> object:
        async for attempt in _retry(store, **kw):
            with attempt:
                ran.append(1)
                raise ConnectionError("down")
        return None

    async def iterator_async_with(ran: list[int]) -> object:
        async for attempt in _retry(store, **kw):
            async with attempt:
                ran.append(1)
                raise ConnectionError("down")
        return None

    async def caller(ran: list[int]) -> object:
        exchange = AsyncExchange()
        try:
            return await _caller(store, **kw).acall(exchange, target=TARGET)
        finally:
            ran.extend([1] * exchange.sent)

    return {"decorator": decorator, "iterator": iterator, "iterator-async-with": iterator_async_with,
            "caller": caller}


def _give_up(exc: BaseException) -> tuple[type[BaseException], bool, str | None]:
    reply = exc.askonce_reply  # type: ignore[attr-defined]
    return type(exc), reply.dnr, reply.reason


def test_sync_forms_give_the_same_give_up_at_an_open_breaker(shared_redis: RedisServer) -> None:
    store = RedisStore(shared_redis.url, prefix=uuid.uuid4().hex, op_timeout=1.0)
    handle = store.breaker(TARGET, OPEN)
    assert handle.allow(0.0)
    handle.record(0.0, success=False)
    seen = {}
    for name, form in sync_forms(store, breaker=OPEN).items():
        ran: list[int] = []
        with pytest.raises(CircuitOpen) as info:
            form(ran)
        assert ran == [], name  # nothing reaches an open breaker's target
        assert info.value.retry_at is not None, name
        seen[name] = _give_up(info.value)
    assert set(seen.values()) == {(CircuitOpen, True, "breaker-open")}, seen


def test_async_forms_await_the_breaker_and_give_the_same_give_up(shared_redis: RedisServer) -> None:
    async def main() -> dict[str, tuple[type[BaseException], bool, str | None]]:
        store = AsyncRedisStore(shared_redis.url, prefix=uuid.uuid4().hex, op_timeout=1.0)
        handle = store.breaker(TARGET, OPEN)
        assert await handle.allow(0.0)
        await handle.record(0.0, success=False)
        seen = {}
        for name, form in async_forms(store, breaker=OPEN).items():
            ran: list[int] = []
            with pytest.raises(CircuitOpen) as info:
                await form(ran)
            assert ran == [], name
            assert info.value.retry_at is not None, name
            seen[name] = _give_up(info.value)
        return seen

    seen = asyncio.run(main())
    assert len(seen) == 4
    assert set(seen.values()) == {(CircuitOpen, True, "breaker-open")}, seen


def test_sync_forms_give_the_same_give_up_at_a_drained_bucket(shared_redis: RedisServer) -> None:
    store = RedisStore(shared_redis.url, prefix=uuid.uuid4().hex, op_timeout=1.0)
    seen = {}
    for name, form in sync_forms(store, bucket=DRAINED).items():
        ran: list[int] = []
        with pytest.raises(RetryThrottled) as info:
            form(ran)
        assert ran == [1], name  # the first attempt, and no retry without a token
        assert isinstance(info.value.__cause__, ConnectionError), name
        seen[name] = _give_up(info.value)
    assert set(seen.values()) == {(RetryThrottled, True, "throttled")}, seen


def test_async_forms_give_the_same_give_up_at_a_drained_bucket(shared_redis: RedisServer) -> None:
    async def main() -> dict[str, tuple[type[BaseException], bool, str | None]]:
        store = AsyncRedisStore(shared_redis.url, prefix=uuid.uuid4().hex, op_timeout=1.0)
        seen = {}
        for name, form in async_forms(store, bucket=DRAINED).items():
            ran: list[int] = []
            with pytest.raises(RetryThrottled) as info:
                await form(ran)
            assert ran == [1], name
            seen[name] = _give_up(info.value)
        return seen

    seen = asyncio.run(main())
    assert len(seen) == 4
    assert set(seen.values()) == {(RetryThrottled, True, "throttled")}, seen


def test_sync_forms_refuse_an_async_store_before_the_body_runs(shared_redis: RedisServer) -> None:
    async def main() -> None:
        store = AsyncRedisStore(shared_redis.url, prefix=uuid.uuid4().hex, op_timeout=1.0)
        for name, form in sync_forms(store, breaker=OPEN).items():  # type: ignore[arg-type]
            ran: list[int] = []
            with pytest.raises(TypeError, match="async"):
                form(ran)
            assert ran == [], name

    asyncio.run(main())


def test_the_iterator_releases_the_breaker_slot_of_an_attempt_it_never_ran() -> None:
    registry = askonce.breakers.BreakerRegistry()
    store = registry.store
    one_probe = BreakerPolicy(window_size=1, minimum_calls=1, open_for=0.001, half_open_probes=1)
    handle = store.breaker(TARGET, one_probe)
    assert handle.allow(0.0)
    handle.record(0.0, success=False)  # open; the next allow after open_for is the one probe
    clock = [1.0]
    form = askonce.retry(on=ConnectionError, layer="api", target=TARGET, store=store,
                         breaker=one_probe, clock=lambda: clock[0], bucket=None)
    for _attempt in form:
        break  # the probe slot was taken for this attempt, and the attempt never ran
    assert handle.allow(clock[0]), "the abandoned attempt's probe slot was not given back"


@pytest.mark.parametrize("flat", [{"attempts": 7}, {"budget": 3}, {"deadline": None},
                                  {"backoff": askonce.Backoff()}, {"idempotent": False}])
def test_policy_and_its_fields_cannot_both_be_given(flat: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="not both"):
        askonce.retry(policy=askonce.RetryPolicy(), **flat)


def test_the_flat_fields_make_the_policy() -> None:
    layer = askonce.retry(attempts=7, budget=3, deadline=None)
    assert layer.policy == askonce.RetryPolicy(attempts=7, budget=3, deadline=None)
    assert askonce.retry().policy == askonce.RetryPolicy()
    policy = askonce.RetryPolicy(attempts=5)
    assert askonce.retry(policy=policy).policy is policy
