"""Hedging on the real stack: an async httpx client (``AsyncAskonceTransport`` with
``ClientPolicy(hedge=...)``) against a real uvicorn target on 127.0.0.1, behind the askonce ASGI
middleware and its ledger.

The target makes the first try of a seeded 2 % of questions hang (until the test ends, 5 s at
most); every other arrival answers at once, with the hop that answered as its body. Nothing here
measures time: events are counted (which try answered, arrivals per question, the budget left), and
the slow tries are so much slower than any fast one that only the order of events matters.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

import askonce
from askonce.client import ClientPolicy
from askonce.core.hedge import HedgePolicy
from askonce.core.ledger import Ledger, LedgerPolicy
from askonce.core.wire import (
    QUESTION_HEADER,
    REPLY_HEADER,
    Malformed,
    Reply,
    format_reply,
    parse_question,
)
from askonce.integrations.asgi import AskonceASGIMiddleware
from askonce.integrations.httpx import AsyncAskonceTransport
from askonce.propagation import new_key
from e2e_services import uvicorn_running
from stats_delta import delta

HANG = 5.0  # the longest a hung try waits for the test to end


class Tail:
    """The target's handler: arrivals and hops per key; the first try of a key in ``slow``
    hangs."""

    def __init__(self, hang: float = HANG) -> None:
        self.hang_s = hang
        self.slow: set[str] = set()
        self.hops: dict[str, list[str]] = {}
        self.lock = threading.Lock()
        self.released = threading.Event()

    def arrivals(self, key: str) -> Counter[str]:
        with self.lock:
            return Counter(self.hops.get(key, ()))

    async def hang(self) -> None:
        end = time.monotonic() + self.hang_s
        while not self.released.is_set() and time.monotonic() < end:
            await asyncio.sleep(0.02)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        q = askonce.current()
        assert q is not None and q.path
        hop = str(q.path[-1])
        with self.lock:
            self.hops.setdefault(q.key, []).append(hop)
        if q.key in self.slow and hop.endswith(":1"):
            await self.hang()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": hop.encode()})


@contextmanager
def target(hang: float = HANG) -> Iterator[tuple[str, Tail, Ledger]]:
    tail, ledger = Tail(hang), Ledger(LedgerPolicy())
    app = AskonceASGIMiddleware(tail, layer="target", ledger=ledger)
    try:
        with uvicorn_running(app) as url:
            yield url, tail, ledger
    finally:
        tail.released.set()


def client(hedge: HedgePolicy) -> httpx.AsyncClient:
    policy = ClientPolicy(layer="edge", bucket=None, admission=None, hedge=hedge)
    return httpx.AsyncClient(transport=AsyncAskonceTransport(policy=policy), timeout=10.0)


# Learns from 20 answers; a generous throttle so that every slow question can be hedged.
LEARNING = HedgePolicy(min_samples=20, every=10, window=200, max_share=0.5, burst=50)


async def ask(http: httpx.AsyncClient, url: str, key: str) -> tuple[httpx.Response, int]:
    """One question (budget 2): the response and the budget it has left afterwards."""
    with askonce.question(budget=2, key=key) as q:
        response = await http.get(url)
        left = askonce.current()
        assert left is not None and left.key == q.key
        return response, left.budget


def test_slow_first_tries_are_answered_by_their_hedges_within_the_budget() -> None:
    calls, rng = 300, random.Random(13)
    slow_at = set(rng.sample(range(40, calls), 6))  # 2 %, after the delay has been learned
    keys = [new_key() for _ in range(calls)]
    before = askonce.stats()
    with target() as (url, tail, ledger):
        tail.slow = {keys[i] for i in slow_at}

        async def main() -> list[tuple[httpx.Response, int]]:
            async with client(LEARNING) as http:
                return [await ask(http, url + "/item", key) for key in keys]

        results = asyncio.run(main())
        tail.released.set()
        time.sleep(0.1)  # the hung tries answer their cancelled callers and are counted
        report = ledger.report(now=time.time())
        seen = {key: tail.arrivals(key) for key in keys}
    fired = delta(before).get("client.hedged", 0)
    spent = 0
    for key, (response, left) in zip(keys, results, strict=True):
        arrivals = seen[key]
        assert response.status_code == 200
        assert sum(arrivals.values()) <= 1 + 2, (key, arrivals)
        assert set(arrivals) <= {"edge:1", "edge:2"}
        winner = response.text
        if key in tail.slow:
            assert winner == "edge:2"  # the first try hung: the hedge answered
        if winner == "edge:2":
            # The hedge cost the reserved one; the first try, cancelled, forfeits what it held.
            assert left == 0
        elif arrivals["edge:2"]:
            assert left == 1  # hedged, and the first try's reply gave back what it held
        else:
            assert left in (1, 2)  # 1: a hedge fired and was cancelled before it arrived
        spent += 2 - left - (1 if winner == "edge:2" else 0)
    assert fired == spent  # every hedge sent cost exactly one, and nothing else was lost
    assert fired >= len(slow_at)
    assert report.totals().arrivals == sum(sum(a.values()) for a in seen.values())
    for op in report.operations:
        assert all(h.arrivals <= 3 for h in op.heavy)


def test_no_hedge_before_the_delay_is_learned_nor_without_budget() -> None:
    keys = [new_key() for _ in range(3)]
    with target(hang=0.3) as (url, tail, _):  # far past the hedge's delay
        tail.slow = set(keys)

        async def main() -> list[tuple[int, int]]:
            out = []
            async with client(HedgePolicy(min_samples=50)) as http:
                for key in keys[:2]:  # nothing learned yet: the slow try is waited for
                    response, left = await ask(http, url + "/a", key)
                    out.append((response.status_code, left))
            async with client(HedgePolicy(delay=0.05)) as http:
                with askonce.question(budget=0, key=keys[2]):  # no budget: no hedge
                    response = await http.get(url + "/b")
                    out.append((response.status_code, 0))
            return out

        results = asyncio.run(main())
        seen = [tail.arrivals(k) for k in keys]
    assert results == [(200, 2), (200, 2), (200, 0)]
    assert seen == [Counter({"edge:1": 1})] * 3


class Pushback:
    """A bare askonce-aware target (no middleware, so it can answer any reply): ``/slow`` hangs on
    a key's first try and answers its hedge 503 do-not-retry with a pushback; ``/fast`` answers
    200 at once."""

    def __init__(self) -> None:
        self.hops: Counter[str] = Counter()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        raw = dict(scope["headers"])[QUESTION_HEADER.encode()]
        q = parse_question(raw, time.monotonic())
        assert not isinstance(q, Malformed)
        hop = str(q.path[-1])
        self.hops[hop] += 1
        status, reply = 200, Reply(q.budget)
        if scope["path"] == "/slow" and hop == "edge:1":
            await asyncio.sleep(0.3)  # long past the hedge's delay
        elif scope["path"] == "/slow":
            status, reply = 503, Reply(0, True, "overloaded", 30.0)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(REPLY_HEADER.encode(), format_reply(reply).encode())]})
        await send({"type": "http.response.body", "body": hop.encode()})


def test_a_pushback_waits_for_the_other_try_and_stops_further_hedges() -> None:
    app = Pushback()
    with uvicorn_running(app) as url:

        async def main() -> list[tuple[str, int]]:
            out = []
            # Throttled less than by default: a token for every second call.
            async with client(HedgePolicy(delay=0.02, max_share=0.5)) as http:
                for _ in range(3):
                    with askonce.question(budget=2):
                        response = await http.get(url + "/slow")
                        q = askonce.current()
                        assert q is not None
                        out.append((response.text, q.budget))
            return out

        results = asyncio.run(main())
    # The hedge's 503 dnr is a retryable failure: the first try is waited for and answers. Its
    # pushback stops hedging to that target: the later calls send one try each.
    assert results == [("edge:1", 1), ("edge:1", 2), ("edge:1", 2)]
    assert app.hops == Counter({"edge:1": 3, "edge:2": 1})


@pytest.mark.parametrize("body", ["stream", "bytes"])
def test_a_body_that_cannot_be_replayed_is_not_hedged(body: str) -> None:
    with target(hang=0.3) as (url, tail, _):

        async def chunks() -> Any:
            yield b"x"

        async def main() -> str:
            key = new_key()
            tail.slow = {key}
            async with client(HedgePolicy(delay=0.01)) as http:
                with askonce.question(budget=2, key=key):
                    content = chunks() if body == "stream" else b"x"
                    await http.put(url + "/p", content=content)
            return key

        key = asyncio.run(main())
        seen = tail.arrivals(key)
    # A PUT is idempotent, but a streamed body cannot be sent twice.
    assert seen == Counter({"edge:1": 1} if body == "stream" else {"edge:1": 1, "edge:2": 1})
