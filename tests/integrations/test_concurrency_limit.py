"""The server middlewares' adaptive concurrency limit on real servers (uvicorn, waitress, 127.0.0.1).

A burst beyond the limit: the excess is answered 503 at once with ``dnr`` reason ``overloaded`` and a
pushback, the requests within it are served, and the ledger counts every arrival.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

import askonce
from askonce.core import wire
from askonce.core.concurrency import ConcurrencyPolicy
from askonce.core.ledger import Ledger, LedgerPolicy
from askonce.core.question import Hop
from askonce.core.wire import QUESTION_HEADER, REPLY_HEADER, Reply
from askonce.integrations.asgi import AskonceASGIMiddleware
from askonce.integrations.wsgi import AskonceWSGIMiddleware
from e2e_services import uvicorn_running, waitress_running

LIMIT = 3
EXCESS = 5
POLICY = ConcurrencyPolicy(initial_limit=LIMIT, min_limit=1, max_limit=LIMIT, pushback=2.0)
WAIT = 10.0  # the most any step may take on a loaded machine


class Gate:
    """Requests that wait in the app until the test opens the gate; how many are inside."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.inside = 0
        self.full = threading.Event()
        self.open = threading.Event()

    def enter(self) -> None:
        with self.lock:
            self.inside += 1
            if self.inside >= LIMIT:
                self.full.set()


def asgi_app(gate: Gate) -> Callable[..., Any]:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        gate.enter()
        limit = time.monotonic() + WAIT
        while not gate.open.is_set() and time.monotonic() < limit:
            await asyncio.sleep(0.005)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    return app


def wsgi_app(gate: Gate) -> Callable[..., Iterable[bytes]]:
    def app(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        gate.enter()
        gate.open.wait(WAIT)
        start_response("200 OK", [("content-type", "text/plain")])
        return [b"ok"]

    return app


def headers() -> dict[str, str]:
    key = askonce.propagation.new_key()
    return {QUESTION_HEADER: wire.format_question(key, "edge", True, 2, 5.0, (Hop("edge", 1),))}


def reply_of(response: httpx.Response) -> Reply:
    parsed = wire.parse_reply(response.headers[REPLY_HEADER])
    assert isinstance(parsed, Reply)
    return parsed


def burst(url: str, gate: Gate) -> tuple[list[httpx.Response], list[httpx.Response]]:
    """LIMIT requests held in the app, then EXCESS more; the gate opens once those are answered."""
    with httpx.Client(timeout=WAIT) as client, ThreadPoolExecutor(LIMIT) as pool:
        held = [pool.submit(client.get, f"{url}/work", headers=headers()) for _ in range(LIMIT)]
        assert gate.full.wait(WAIT), "the first requests did not reach the app"
        try:
            excess = [client.get(f"{url}/work", headers=headers()) for _ in range(EXCESS)]
        finally:
            gate.open.set()
        return [f.result(WAIT) for f in held], excess


def check(held: list[httpx.Response], excess: list[httpx.Response], ledger: Ledger,
          gate: Gate) -> None:
    assert [r.status_code for r in held] == [200] * LIMIT
    assert [r.status_code for r in excess] == [503] * EXCESS
    for response in excess:
        assert response.headers["retry-after"] == "2"
        assert reply_of(response) == Reply(2, True, "overloaded", 2.0)
        assert response.text == "askonce: overloaded\n"
    assert gate.inside == LIMIT  # the refused never ran
    assert ledger.report(time.time()).totals().arrivals == LIMIT + EXCESS


@pytest.mark.parametrize("server", ["asgi", "wsgi"])
def test_a_burst_beyond_the_limit_is_refused_at_once_and_still_counted(server: str) -> None:
    gate, ledger = Gate(), Ledger(LedgerPolicy(window=86_400.0))
    if server == "asgi":
        app: Any = AskonceASGIMiddleware(asgi_app(gate), layer="target", ledger=ledger,
                                         concurrency=POLICY)
        running = uvicorn_running(app)
    else:
        app = AskonceWSGIMiddleware(wsgi_app(gate), layer="target", ledger=ledger,
                                    concurrency=POLICY)
        running = waitress_running(app)
    with running as url:
        held, excess = burst(url, gate)
        check(held, excess, ledger, gate)
        # The slots are given back once the answers are out: the next request is served.
        limiter = app.server.limiter
        deadline = time.monotonic() + WAIT
        while limiter.inflight and time.monotonic() < deadline:
            time.sleep(0.01)
        assert limiter.inflight == 0
        assert httpx.get(f"{url}/work", headers=headers(), timeout=WAIT).status_code == 200


def test_off_by_default_nothing_is_refused() -> None:
    gate, ledger = Gate(), Ledger(LedgerPolicy(window=86_400.0))
    app = AskonceASGIMiddleware(asgi_app(gate), layer="target", ledger=ledger)
    assert app.server.limiter is None
    n = LIMIT + EXCESS
    with uvicorn_running(app) as url, httpx.Client(timeout=WAIT) as client, \
            ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(client.get, f"{url}/work", headers=headers()) for _ in range(n)]
        deadline = time.monotonic() + WAIT
        while gate.inside < n and time.monotonic() < deadline:
            time.sleep(0.01)
        gate.open.set()
        assert gate.inside == n  # all in the app at once
        assert [f.result(WAIT).status_code for f in futures] == [200] * n


def test_a_concurrency_that_is_not_a_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="concurrency must be"):
        AskonceWSGIMiddleware(wsgi_app(Gate()), layer="target",
                              concurrency=10)  # type: ignore[arg-type]
