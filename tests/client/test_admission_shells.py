"""Adaptive admission in the real shells: ``ClientPolicy(admission=...)`` through the httpx transport
against a real HTTP target on 127.0.0.1, and ``@askonce.retry(admission=...)`` in process.

A dead target: after ``min_requests`` nearly every attempt is shed (``CircuitOpen``, reason
``shed``) and the target sees a trickle. A target failing every other call: nothing is shed, and
the retries answer more than one attempt alone would. The first attempt goes through admission
too (it has a fast path without it). Every clock is frozen so that the window never rolls.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

import askonce
from askonce import RetryPolicy
from askonce.client import ClientPolicy
from askonce.core.admission import AdmissionPolicy
from askonce.core.backoff import NO_WAIT
from askonce.integrations.httpx import AskonceTransport, AsyncAskonceTransport
from askonce.stores.memory import AdmissionHandle, MemoryStore
from http_target import Target, policy

MODES = ["sync", "async"]
QUESTIONS = 400
ADMISSION = AdmissionPolicy(window=10, min_requests=20)
NEVER_SHEDS = AdmissionPolicy(min_requests=1_000_000_000)  # counts every attempt, refuses none
RETRY = RetryPolicy(attempts=3, backoff=NO_WAIT)  # budget 2: at most 3 arrivals per question


def frozen() -> float:
    return 100.0


# --- targets (``target``, the shared one, comes from tests/conftest.py) ---------------------------


class Alternating:
    """An HTTP target that fails (503) every other arrival, the first included: 50 %, exactly."""

    def __init__(self) -> None:
        self.arrivals = 0
        lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                with lock:
                    outer.arrivals += 1
                    failed = outer.arrivals % 2 == 1
                body = b"no" if failed else b"ok"
                self.send_response(503 if failed else 200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        self.thread = threading.Thread(target=self.server.serve_forever,
                                       kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def alternating() -> Iterator[Alternating]:
    t = Alternating()
    yield t
    t.close()


# --- the client shell through httpx ---------------------------------------------------------------


def _questions(mode: str, p: ClientPolicy, url: str, store: MemoryStore, n: int) -> list[Any]:
    """``n`` questions through the httpx transport, one after another: each one's response, or the
    exception it raised."""
    kw: dict[str, Any] = {"policy": p, "store": store, "clock": frozen,
                          "random": random.Random(1).random, "target": lambda request: "t"}
    out: list[Any] = []
    if mode == "sync":
        with httpx.Client(transport=AskonceTransport(**kw), timeout=5.0) as client:
            for _ in range(n):
                try:
                    out.append(client.get(url))
                except askonce.GaveUp as exc:
                    out.append(exc)
        return out

    async def go() -> None:
        async with httpx.AsyncClient(transport=AsyncAskonceTransport(**kw), timeout=5.0) as client:
            for _ in range(n):
                try:
                    out.append(await client.get(url))
                except askonce.GaveUp as exc:
                    out.append(exc)

    asyncio.run(go())
    return out


def _shed(outcome: Any) -> bool:
    """A question this layer's admission ended: raised (its first attempt shed) or returned with
    the last failed response and the shed reply."""
    reply = getattr(outcome, "askonce_reply", None)
    return reply is not None and reply.dnr and reply.reason == "shed"


@pytest.mark.parametrize("mode", MODES)
def test_a_dead_target_is_shed_down_to_a_trickle(mode: str, target: Target) -> None:
    store = MemoryStore(frozen)
    outcomes = _questions(mode, policy(retry=RETRY, admission=ADMISSION), target.url("/fail"),
                          store, QUESTIONS)
    raised = [o for o in outcomes if isinstance(o, askonce.CircuitOpen)]
    assert all(o.reason == "shed" for o in raised)
    assert len(raised) >= 0.9 * QUESTIONS  # most questions: the first attempt shed, nothing sent
    assert sum(map(_shed, outcomes)) >= 0.9 * QUESTIONS
    assert not any(isinstance(o, httpx.Response) and o.status_code == 200 for o in outcomes)
    # Without admission: 3 * 400 = 1200 arrivals. With it: the first min_requests, then ~1-4 %.
    assert target.total < 60
    snap = store.admission("t", ADMISSION).snapshot()
    assert snap["calls"] == target.total and snap["successes"] == 0


@pytest.mark.parametrize("mode", MODES)
def test_a_half_failing_target_is_never_shed_and_retries_still_answer(
        mode: str, alternating: Alternating) -> None:
    store = MemoryStore(frozen)
    outcomes = _questions(mode, policy(retry=RETRY, admission=ADMISSION), alternating.url, store,
                          QUESTIONS)
    assert not any(map(_shed, outcomes))
    answered = sum(isinstance(o, httpx.Response) and o.status_code == 200 for o in outcomes)
    assert answered / QUESTIONS >= 0.5  # what one attempt alone gets; the retries bring the rest
    assert answered == QUESTIONS
    assert alternating.arrivals == 2 * QUESTIONS
    snap = store.admission("t", ADMISSION).snapshot()
    assert (snap["requests"], snap["calls"], snap["successes"]) == (2 * QUESTIONS, 2 * QUESTIONS,
                                                                    QUESTIONS)


@pytest.mark.parametrize("path", ["/fail", "/ok"])
@pytest.mark.parametrize("mode", MODES)
def test_the_first_attempt_is_admitted_and_recorded(mode: str, path: str, target: Target) -> None:
    # One attempt per question: only the first-attempt path runs, the one that has a fast lane.
    store = MemoryStore(frozen)
    p = policy(retry=RetryPolicy(attempts=1, backoff=NO_WAIT), admission=NEVER_SHEDS)
    handle = store.admission("t", NEVER_SHEDS)
    for n in range(1, 6):
        (outcome,) = _questions(mode, p, target.url(path), store, 1)
        assert isinstance(outcome, httpx.Response)
        snap = handle.snapshot()
        assert (snap["requests"], snap["calls"]) == (n, n)
        assert snap["successes"] == (n if path == "/ok" else 0)
    assert target.total == 5


@pytest.mark.parametrize("mode", MODES)
def test_admission_is_on_by_default_and_off_with_none(mode: str, target: Target) -> None:
    store = MemoryStore(frozen)
    default = ClientPolicy(layer="web", retry=RETRY, bucket=None)  # admission as by default
    outcomes = _questions(mode, default, target.url("/ok"), store, 3)
    assert all(isinstance(o, httpx.Response) and o.status_code == 200 for o in outcomes)
    snap = store.admission("t", AdmissionPolicy()).snapshot()
    assert (snap["requests"], snap["calls"], snap["successes"]) == (3, 3, 3)
    off = MemoryStore(frozen)
    _questions(mode, policy(retry=RETRY, admission=None), target.url("/ok"), off, 3)
    assert not off._admissions


def test_admission_must_be_a_policy_and_a_store_without_it_uses_the_process_memory() -> None:
    with pytest.raises(ValueError, match=r"admission must be AdmissionPolicy\(...\) or None"):
        ClientPolicy(admission=0.05)  # type: ignore[arg-type]

    class Buckets:  # a store of the application's own, older than admission
        def bucket(self, target: str, policy: Any) -> Any:
            return MemoryStore(frozen).bucket(target, policy)

    caller = askonce.client.Caller(policy(admission=ADMISSION), store=Buckets())  # type: ignore[arg-type]
    assert caller._admissions == askonce.stores.default_store().admission


# --- @askonce.retry in process --------------------------------------------------------------------

FORMS = ["decorator-sync", "decorator-async", "iterator-sync", "iterator-async"]


class Flaky:
    """A function that fails (ConnectionError) always, or every other call, the first included."""

    def __init__(self, every_other: bool) -> None:
        self.calls = 0
        self.every_other = every_other

    def __call__(self) -> str:
        self.calls += 1
        if not self.every_other or self.calls % 2 == 1:
            raise ConnectionError("down")
        return "ok"


def _retried(form: str, fn: Flaky, store: MemoryStore, admission: AdmissionPolicy,
             n: int, retry: RetryPolicy = RETRY) -> list[Any]:
    """``n`` questions through ``@askonce.retry`` (or its iterator form): results or exceptions."""
    layer = askonce.retry(policy=retry, admission=admission, store=store, clock=frozen,
                          random=random.Random(1).random, bucket=None, layer="api", target="t")
    out: list[Any] = []
    if form == "decorator-sync":
        wrapped = layer(fn)
        for _ in range(n):
            try:
                out.append(wrapped())
            except (askonce.GaveUp, ConnectionError) as exc:
                out.append(exc)
        return out
    if form == "iterator-sync":
        for _ in range(n):
            try:
                for attempt in layer:
                    with attempt:
                        out.append(fn())
            except (askonce.GaveUp, ConnectionError) as exc:
                out.append(exc)
        return out

    async def once() -> str:
        return fn()

    async def go() -> None:
        wrapped = layer(once)
        for _ in range(n):
            try:
                if form == "decorator-async":
                    out.append(await wrapped())
                else:
                    async for attempt in layer:
                        async with attempt:
                            out.append(fn())
            except (askonce.GaveUp, ConnectionError) as exc:
                out.append(exc)

    asyncio.run(go())
    return out


@pytest.mark.parametrize("form", FORMS)
def test_retry_sheds_a_function_that_always_fails(form: str) -> None:
    store, fn = MemoryStore(frozen), Flaky(every_other=False)
    outcomes = _retried(form, fn, store, ADMISSION, QUESTIONS)
    assert all(isinstance(o, askonce.GaveUp | ConnectionError) for o in outcomes)
    shed = [o for o in outcomes if isinstance(o, askonce.CircuitOpen)]
    assert all(o.reason == "shed" for o in shed)
    assert len(shed) >= 0.9 * QUESTIONS
    assert fn.calls < 60  # 1200 without admission
    snap = store.admission("t", ADMISSION).snapshot()
    assert snap["calls"] == fn.calls and snap["successes"] == 0


@pytest.mark.parametrize("form", FORMS)
def test_retry_never_sheds_a_function_that_fails_every_other_call(form: str) -> None:
    store, fn = MemoryStore(frozen), Flaky(every_other=True)
    outcomes = _retried(form, fn, store, ADMISSION, QUESTIONS)
    assert not any(isinstance(o, askonce.CircuitOpen) for o in outcomes)
    answered = outcomes.count("ok")
    assert answered / QUESTIONS >= 0.5 and answered == QUESTIONS
    assert fn.calls == 2 * QUESTIONS
    snap = store.admission("t", ADMISSION).snapshot()
    assert (snap["calls"], snap["successes"]) == (2 * QUESTIONS, QUESTIONS)


@pytest.mark.parametrize("form", FORMS)
def test_retry_admits_and_records_the_first_attempt(form: str) -> None:
    store, fn = MemoryStore(frozen), Flaky(every_other=False)
    handle: AdmissionHandle = store.admission("t", NEVER_SHEDS)
    for n in range(1, 6):
        (outcome,) = _retried(form, fn, store, NEVER_SHEDS, 1,
                              retry=RetryPolicy(attempts=1, backoff=NO_WAIT))
        assert isinstance(outcome, askonce.GaveUp | ConnectionError)
        snap = handle.snapshot()
        assert (snap["requests"], snap["calls"], snap["successes"]) == (n, n, 0)
    assert fn.calls == 5


@pytest.mark.parametrize("form", ["sync", "async"])
def test_the_functions_own_errors_are_no_verdict_on_the_target(form: str) -> None:
    # @askonce.retry wraps any code: a KeyError it does not retry (not in on=) is the function's own
    # failure, not the dependency's, so it cannot make the default admission shed the calls after it.
    store = MemoryStore(frozen)
    calls = {"n": 0}

    def work(fail: bool) -> int:
        calls["n"] += 1
        if fail:
            raise KeyError("no such order")
        return 1

    async def awork(fail: bool) -> int:
        return work(fail)

    layer = askonce.retry(on=ConnectionError, layer="t", store=store, clock=frozen)
    fn: Any = layer(awork) if form == "async" else layer(work)

    def call(fail: bool) -> Any:
        return asyncio.run(fn(fail)) if form == "async" else fn(fail)

    for _ in range(30):
        with pytest.raises(KeyError):
            call(True)
    assert [call(False) for _ in range(20)] == [1] * 20
    snap = store.admission("t", AdmissionPolicy()).snapshot()
    assert (snap["requests"], snap["calls"], snap["successes"]) == (50, 20, 20)
