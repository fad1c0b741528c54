"""What ``import askonce`` writes out instead of importing ``inspect`` agrees with ``inspect``.

``askonce._loop.isawaitable`` is ``inspect.isawaitable``; ``askonce.retrying.function_kind`` is
``inspect``'s generator and coroutine function tests, read from a plain function's code flags.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import subprocess
import sys
import types
from collections.abc import Awaitable, Callable, Generator
from typing import Any

import pytest

from askonce._loop import isawaitable
from askonce.retrying import function_kind


def plain() -> int:
    return 1


async def coroutine_function() -> int:
    return 1


def generator_function() -> Generator[int, None, None]:
    yield 1


async def async_generator_function() -> Any:
    yield 1


@types.coroutine
def generator_coroutine() -> Generator[None, None, int]:
    yield
    return 1


class Methods:
    def sync(self) -> int:
        return 1

    async def asynchronous(self) -> int:
        return 1

    def __call__(self) -> int:
        return 1


class AwaitableObject:
    def __await__(self) -> Generator[None, None, int]:
        yield
        return 1


@functools.wraps(coroutine_function)
def sync_wrapper_of_a_coroutine_function() -> Awaitable[int]:
    return coroutine_function()


def marked() -> Awaitable[int]:
    return coroutine_function()


if hasattr(inspect, "markcoroutinefunction"):  # Python 3.12
    inspect.markcoroutinefunction(marked)

FUNCTIONS: list[Callable[..., Any]] = [
    plain, coroutine_function, generator_function, async_generator_function, generator_coroutine,
    Methods().sync, Methods().asynchronous, Methods(), Methods.sync, Methods.asynchronous,
    functools.partial(coroutine_function), functools.partial(generator_function),
    functools.partial(functools.partial(plain)), sync_wrapper_of_a_coroutine_function, marked,
    lambda: 1, print, len, type, asyncio.sleep, AwaitableObject,
]


@pytest.mark.parametrize("fn", FUNCTIONS, ids=repr)
def test_function_kind_is_what_inspect_says(fn: Callable[..., Any]) -> None:
    expected = (inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn),
                inspect.iscoroutinefunction(fn))
    assert function_kind(fn) == expected


def test_the_sample_covers_every_kind() -> None:
    assert {function_kind(fn) for fn in FUNCTIONS} == {(False, False), (True, False), (False, True)}


def _values() -> list[object]:
    async def sleeper() -> None:
        await asyncio.sleep(0)

    return [sleeper(), generator_coroutine(), generator_function(), AwaitableObject(),
            asyncio.sleep(0), 1, None, "text", plain, coroutine_function, object()]


def test_isawaitable_is_what_inspect_says() -> None:
    values = _values()
    try:
        got = [isawaitable(v) for v in values]
        assert got == [inspect.isawaitable(v) for v in values]
        assert True in got and False in got
    finally:
        for v in values:
            close = getattr(v, "close", None)
            if isinstance(v, types.CoroutineType | types.GeneratorType) and close is not None:
                close()


def test_import_askonce_decorating_and_a_call_import_no_inspect_and_no_dataclasses() -> None:
    # inspect (with ast, dis and tokenize) and dataclasses cost more than the rest of askonce's
    # import: docs/benchmarks.md, "Import time". (An async function's wrapper imports asyncio,
    # which imports inspect.)
    code = ("import sys, askonce\n"
            "@askonce.retry(on=ConnectionError)\n"
            "def f(): return 1\n"
            "assert f() == 1\n"  # the first call makes the default (memory) store
            "print(sorted(m for m in ('inspect', 'dataclasses') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=60).stdout
    assert out.strip() == "[]"


def test_the_wire_expressions_compile_on_the_first_header_and_then_stay_compiled() -> None:
    code = """
import re, askonce
from askonce.core import wire
names = ("_canonical_fullmatch", "_key_fullmatch", "_name_fullmatch")
print([getattr(getattr(wire, n), "__self__", None) for n in names])  # stand-ins: functions
canonical = 'v=1, k="01HF7YAT0000041061050R3GG28A1C60T3GF", o=edge, e, b=2, d=2500, p=(edge:1 gw:2)'
general = 'v=1, b=2, k="01HF7YAT0000041061050R3GG28A1C60T3GF", o=edge'
first = [wire.parse_question(canonical, 0.0), wire.parse_question(general, 0.0)]
compiled = [getattr(wire, n).__self__ for n in names]
print(all(isinstance(p, re.Pattern) for p in compiled))
again = [wire.parse_question(canonical, 0.0), wire.parse_question(general, 0.0)]
print([getattr(wire, n).__self__ for n in names] == compiled, first == again)
print(first[0].key == first[1].key, first[0].budget, [str(h) for h in first[0].path])
print(wire.valid_name("gw"), wire.valid_name("9gw"), wire.parse_question('v=1, k="short", o=a, b=1', 0.0))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=60).stdout.splitlines()
    assert out == ["[None, None, None]", "True", "True True", "True 2 ['edge:1', 'gw:2']",
                   "True False Malformed(reason='key')"]
