"""Async-with-callback end to end, by long-poll: three real services on 127.0.0.1 (uvicorn, each
in a thread), edge -> middle -> target, the target taking 5 s while every layer's timeout is 1 s.

* naive: plain retries, 3 tries per layer, no askonce: every try times out, and the tries
  multiply at the target (3 x 3 arrivals and runs per question), with no answer;
* askonce: every layer asks ``Prefer: respond-async`` (``ClientPolicy(respond_async=True)``) of
  a joining callee, which answers 202 and works in the background; each layer long-polls its
  callee's status location. The answer is delivered once: the target's handler runs once per
  question, and the question arrives there at most ``1 + budget`` times (once, in fact).

Counts only: arrivals and runs per question at the target, answers at the caller.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx

from askonce import RetryPolicy
from askonce.client import ClientPolicy
from askonce.core.ledger import Ledger, LedgerPolicy
from askonce.integrations.asgi import AskonceASGIMiddleware
from askonce.integrations.asgi_join import STATUS_PATH, JoinASGIMiddleware
from askonce.integrations.httpx import AsyncAskonceTransport
from e2e_services import BACKOFF, uvicorn_running

WORK = 5.0  # seconds the target takes per run
TIMEOUT = 1.0  # every layer's timeout per try
TRIES = 3  # every layer's tries
BUDGET = 2  # the question's retries, minted at the edge
QUESTIONS = 5
RID = "x-request-id"


class Target:
    """Counts arrivals (requests, status polls apart) and runs per request id; runs take
    ``WORK``."""

    def __init__(self) -> None:
        self.arrivals: Counter[str] = Counter()
        self.runs: Counter[str] = Counter()
        self.polls = 0
        self.running = 0
        self.lock = threading.Lock()

    async def handler(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        while (await receive()).get("more_body", False):
            pass
        rid = dict(scope["headers"]).get(RID.encode(), b"-").decode()
        with self.lock:
            self.runs[rid] += 1
            self.running += 1
        try:
            await asyncio.sleep(WORK)
        finally:
            with self.lock:
                self.running -= 1
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"answer"})

    def counting(self, app: Any) -> Any:
        async def counted(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] == "http":
                with self.lock:
                    if str(scope["path"]).startswith(STATUS_PATH):
                        self.polls += 1
                    else:
                        self.arrivals[dict(scope["headers"]).get(RID.encode(), b"-").decode()] += 1
            await app(scope, receive, send)

        return counted

    def settle(self, limit: float = 30.0) -> None:
        """Wait (bounded) until no run is in flight, so that every count is final."""
        end = time.monotonic() + limit
        while time.monotonic() < end:
            with self.lock:
                if not self.running:
                    return
            time.sleep(0.05)


def naive_relay(downstream: str) -> Any:
    """A layer with plain retries: up to ``TRIES`` tries of ``TIMEOUT`` each, no askonce."""
    client = httpx.AsyncClient(timeout=TIMEOUT)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        while (await receive()).get("more_body", False):
            pass
        rid = dict(scope["headers"]).get(RID.encode(), b"-").decode()
        status, body = 504, b"timed out"
        for _ in range(TRIES):
            try:
                r = await client.post(downstream + "/work", headers={RID: rid})
            except httpx.HTTPError:
                await asyncio.sleep(0.01)
                continue
            status, body = r.status_code, r.content
            break
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": body})

    return app


def askonce_relay(layer: str, downstream: str) -> Any:
    """A layer with the askonce client in async mode: ``TRIES`` tries, ``TIMEOUT`` each."""
    policy = ClientPolicy(layer=layer, bucket=None, admission=None, attempt_timeout=TIMEOUT,
                          respond_async=True, retry=RetryPolicy(attempts=TRIES, backoff=BACKOFF))
    client = httpx.AsyncClient(transport=AsyncAskonceTransport(policy=policy), timeout=30.0)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        while (await receive()).get("more_body", False):
            pass
        rid = dict(scope["headers"]).get(RID.encode(), b"-").decode()
        try:
            r = await client.post(downstream + "/work", headers={RID: rid})
            status, body = r.status_code, r.content
        except Exception as exc:  # a give-up: answered as this layer's failure
            status, body = 503, repr(exc)[:200].encode()
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": body})

    return app


@contextmanager
def stack(use_askonce: bool) -> Iterator[tuple[str, Target, Ledger]]:
    target, ledger = Target(), Ledger(LedgerPolicy(window=86_400.0))
    with ExitStack() as running:
        if use_askonce:
            t_url = running.enter_context(uvicorn_running(target.counting(AskonceASGIMiddleware(
                JoinASGIMiddleware(target.handler), layer="target", ledger=ledger))))
            m_url = running.enter_context(uvicorn_running(AskonceASGIMiddleware(
                JoinASGIMiddleware(askonce_relay("middle", t_url)), layer="middle")))
            e_url = running.enter_context(uvicorn_running(AskonceASGIMiddleware(
                askonce_relay("edge", m_url), layer="edge", originator=True, budget=BUDGET,
                deadline=20.0)))
        else:
            t_url = running.enter_context(uvicorn_running(target.counting(target.handler)))
            m_url = running.enter_context(uvicorn_running(naive_relay(t_url)))
            e_url = running.enter_context(uvicorn_running(naive_relay(m_url)))
        yield e_url, target, ledger
        target.settle()


def _ask_all(url: str) -> list[httpx.Response]:
    with httpx.Client(timeout=60.0) as http, concurrent.futures.ThreadPoolExecutor(QUESTIONS) as pool:
        return list(pool.map(lambda i: http.post(url + "/ask", headers={RID: f"q{i}"}),
                             range(QUESTIONS)))


def test_naive_layers_time_out_and_multiply_at_the_target() -> None:
    with stack(use_askonce=False) as (url, target, _):
        answers = _ask_all(url)
    assert [r.status_code for r in answers] == [504] * QUESTIONS  # nobody got the answer
    ids = [f"q{i}" for i in range(QUESTIONS)]
    assert [target.arrivals[i] for i in ids] == [TRIES * TRIES] * QUESTIONS
    assert [target.runs[i] for i in ids] == [TRIES * TRIES] * QUESTIONS  # the work, 9 times


def test_askonce_delivers_each_answer_once_by_long_poll() -> None:
    with stack(use_askonce=True) as (url, target, ledger):
        answers = _ask_all(url)
    assert [(r.status_code, r.text) for r in answers] == [(200, "answer")] * QUESTIONS
    ids = [f"q{i}" for i in range(QUESTIONS)]
    assert [target.runs[i] for i in ids] == [1] * QUESTIONS  # the work, once per question
    assert all(target.arrivals[i] <= 1 + BUDGET for i in ids)
    (op,) = [o for o in ledger.report(now=time.time()).operations if o.operation.endswith("/work")]
    assert op.per_key.max is not None and op.per_key.max <= 1 + BUDGET
    assert op.coverage == 1.0  # every arrival of the question's operation carried its key
    # The polls are not arrivals of the question: bounded by the time they wait, about one a
    # second per question at a timeout of 1 s.
    assert QUESTIONS <= target.polls <= QUESTIONS * (2 * WORK / TIMEOUT + 4)
