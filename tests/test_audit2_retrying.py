"""Audit 2, ``@askonce.retry`` on what it is given: BaseExceptions are never retried nor swallowed (not
even by a catch-all predicate), generator functions are refused, classmethods and methods work."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest

import askonce
from askonce.core.backoff import NO_WAIT


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
