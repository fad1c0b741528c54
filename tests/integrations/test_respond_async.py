"""Async mode at the caller (``ClientPolicy(respond_async=True)``) against real uvicorn servers on
127.0.0.1, for the httpx sync and async transports and the requests adapter.

The callee joins (``JoinASGIMiddleware`` inside ``AskonceASGIMiddleware`` with a ledger) and its
handler takes longer than the client's timeout: in async mode the caller gets the answer, the
handler runs once, the question arrives once and the polls are few; without it the same client
times out and retries. A 202 that sends the caller to another host is not followed; a location
that answers 404 fails the try closed.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import requests

import askonce
from askonce.client import ClientPolicy
from askonce.core.ledger import Ledger, LedgerPolicy
from askonce.errors import AnswerLost
from askonce.integrations.asgi import AskonceASGIMiddleware
from askonce.integrations.asgi_join import STATUS_PATH, JoinASGIMiddleware
from askonce.integrations.httpx import AskonceTransport, AsyncAskonceTransport
from askonce.integrations.requests import session
from e2e_services import uvicorn_running

SLOW = 2.5  # seconds a question's run takes: longer than the client's timeout
LONG = 6.0  # ... at /long: longer than three tries of it
TIMEOUT = 1.0  # the client's timeout per try, the framework's and the policy's alike
KINDS = ["httpx", "httpx-async", "requests"]


class Callee:
    """A joining ASGI callee that counts its runs per question key, its requests per path (the
    status location's apart) and the ``Prefer`` it was sent; ``/warm`` answers at once, ``/long``
    takes ``LONG``, ``/fail`` fails its run."""

    def __init__(self) -> None:
        self.runs: Counter[str] = Counter()
        self.requests: Counter[str] = Counter()
        self.prefers: list[str] = []
        self.lock = threading.Lock()
        self.ledger = Ledger(LedgerPolicy(window=86_400.0))

        async def handler(scope: dict[str, Any], receive: Any, send: Any) -> None:
            while (await receive()).get("more_body", False):
                pass
            q = askonce.current()
            with self.lock:
                self.runs[q.key if q is not None else "-"] += 1
            if scope["path"] == "/fail":
                raise RuntimeError("the run fails: no answer is kept")
            if scope["path"] != "/warm":
                await asyncio.sleep(LONG if scope["path"] == "/long" else SLOW)
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"done"})

        def user(scope: dict[str, Any]) -> str:
            return dict(scope["headers"]).get(b"x-user", b"").decode()

        self.app = AskonceASGIMiddleware(JoinASGIMiddleware(handler, principal=user),
                                         layer="target", ledger=self.ledger)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            path = str(scope["path"])
            with self.lock:
                self.requests[STATUS_PATH if path.startswith(STATUS_PATH) else path] += 1
                self.prefers += [v.decode() for k, v in scope["headers"] if k == b"prefer"]
        await self.app(scope, receive, send)

    def arrivals(self, path: str) -> int:
        """The ledger's arrivals of the question operations at ``path`` (any method)."""
        report = self.ledger.report(now=time.time())
        return sum(op.arrivals for op in report.operations if op.operation.endswith(" " + path))


@contextmanager
def running(app: Any) -> Iterator[str]:
    with uvicorn_running(app) as url:
        yield url


def _policy(respond_async: bool) -> ClientPolicy:
    return ClientPolicy(layer="svc", bucket=None, admission=None, attempt_timeout=TIMEOUT,
                        respond_async=respond_async)


def ask(kind: str, policy: ClientPolicy, url: str, **headers: str) -> Any:
    """One POST with the client ``kind``, in the question bound by the caller; each try limited
    to ``TIMEOUT`` by the framework too."""
    headers = {"x-user": "alice", **headers}
    if kind == "httpx":
        with httpx.Client(transport=AskonceTransport(policy=policy), timeout=TIMEOUT) as http:
            return http.post(url, content=b"order", headers=headers)
    if kind == "requests":
        with session(policy) as http:
            return http.post(url, data=b"order", headers=headers, timeout=TIMEOUT)

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=AsyncAskonceTransport(policy=policy),
                                     timeout=TIMEOUT) as http:
            return await http.post(url, content=b"order", headers=headers)

    return asyncio.run(go())


def _left() -> int:
    q = askonce.current()
    assert q is not None
    return q.budget


@pytest.mark.parametrize("kind", KINDS)
def test_in_async_mode_the_caller_gets_the_answer_of_one_run_without_a_retry(kind: str) -> None:
    callee = Callee()
    with running(callee) as url:
        ask(kind, _policy(True), url + "/warm")  # the client learns that the callee joins
        with askonce.question(budget=2, deadline=20.0) as q:
            response = ask(kind, _policy(True), url + "/orders", prefer="return=minimal")
            left = _left()
    assert response.status_code == 200 and response.text == "done"
    assert response.headers["askonce-joined"] == "replay"
    assert callee.runs[q.key] == 1  # the work was done once
    assert callee.requests["/orders"] == 1 and callee.arrivals("/orders") == 1  # no retry
    # Polls, not tries: one a second at most (a timeout under 2 s asks for no hold), bounded.
    assert 1 <= callee.requests[STATUS_PATH] <= 2 * SLOW / TIMEOUT + 4
    assert "return=minimal, respond-async" in callee.prefers
    assert left == 0  # what the run was forwarded stays with it (the 202 said b=0): fail closed


@pytest.mark.parametrize("kind", KINDS)
def test_without_async_mode_the_same_client_times_out_and_retries(kind: str) -> None:
    callee = Callee()
    with running(callee) as url:
        ask(kind, _policy(False), url + "/warm")
        timed_out = (askonce.AskonceError, httpx.TimeoutException, requests.Timeout)
        with askonce.question(budget=2, deadline=20.0) as q, pytest.raises(timed_out):
            ask(kind, _policy(False), url + "/long")
    # Each timed-out try re-attaches to the run (it joins): a new arrival each time, no answer.
    assert callee.arrivals("/long") == 1 + 2 and callee.runs[q.key] == 1
    assert callee.requests[STATUS_PATH] == 0


class Elsewhere:
    """A callee answering 202 with the preference applied and a location on ``other``."""

    def __init__(self) -> None:
        self.other = ""
        self.seen: Counter[str] = Counter()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        self.seen[str(scope["path"])] += 1
        await send({"type": "http.response.start", "status": 202, "headers": [
            (b"location", f"{self.other}/.askonce/answers/x".encode()),
            (b"preference-applied", b"respond-async")]})
        await send({"type": "http.response.body", "body": b"go there"})


@pytest.mark.parametrize("kind", KINDS)
def test_a_location_on_another_host_is_not_followed(kind: str) -> None:
    hostile, other = Elsewhere(), Elsewhere()
    offsite = askonce.stats().get("client.async.offsite", 0)
    with running(other) as other_url, running(hostile) as url:
        hostile.other = other_url  # another port of 127.0.0.1: another origin
        with askonce.question(budget=2, deadline=20.0):
            response = ask(kind, _policy(True), url + "/orders")
    assert response.status_code == 202  # the callee's answer, as it came
    assert sum(other.seen.values()) == 0 and hostile.seen["/orders"] == 1
    assert askonce.stats().get("client.async.offsite", 0) == offsite + 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_404_at_the_location_fails_the_try_closed(kind: str) -> None:
    callee = Callee()
    with running(callee) as url, askonce.question(budget=2, deadline=20.0) as q:
        with pytest.raises(AnswerLost) as lost:
            ask(kind, _policy(True), url + "/fail")
        left = _left()
    assert lost.value.gone
    assert callee.runs[q.key] == 1 and callee.arrivals("/fail") == 1  # never tried again
    assert callee.requests[STATUS_PATH] >= 1
    assert left == 0  # the run may have spent what it was forwarded


class Flaky:
    """A status location that fails its first poll with 500 before the real callee answers."""

    def __init__(self, callee: Callee) -> None:
        self.callee = callee
        self.failed = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and str(scope["path"]).startswith(STATUS_PATH) \
                and not self.failed:
            self.failed += 1
            await send({"type": "http.response.start", "status": 500, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        await self.callee(scope, receive, send)


def test_a_poll_that_fails_is_polled_again_not_retried_as_a_try() -> None:
    callee = Callee()
    flaky = Flaky(callee)
    with running(flaky) as url, askonce.question(budget=2, deadline=20.0) as q:
        response = ask("httpx", _policy(True), url + "/orders")
    assert flaky.failed == 1 and response.status_code == 200 and response.text == "done"
    assert callee.runs[q.key] == 1 and callee.arrivals("/orders") == 1


def test_polls_stop_at_the_question_s_deadline() -> None:
    """Toward a callee not yet known to join, the lost try of a POST is not retried: the caller
    gets AnswerLost (not gone: the question ran out of time)."""
    callee = Callee()
    with running(callee) as url, askonce.question(budget=2, deadline=1.5) as q, \
            pytest.raises(AnswerLost) as lost:
        ask("httpx", _policy(True), url + "/orders")
    assert not lost.value.gone
    assert callee.runs[q.key] == 1 and callee.arrivals("/orders") == 1
    assert 1 <= callee.requests[STATUS_PATH] <= 4
