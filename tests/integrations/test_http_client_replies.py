"""The httpx and requests clients against what a callee may send back, on a real socket server.

The server (``Canned``) answers every request with a response head written by the test, byte for byte:
duplicated, oversized, non-ASCII or absurd ``askonce-reply`` and ``Retry-After`` values, and bodiless
statuses. Whatever comes back, the clients must not crash, must count what they could not use, and must
fall back as documented (``docs/protocol.md``): a reply that cannot be read is no reply. A timeout they
cannot use is refused before any budget is held.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import requests

import askonce
from askonce import RetryPolicy
from askonce.client import ClientPolicy
from askonce.core.backoff import NO_WAIT
from askonce.integrations.httpx import AskonceTransport, AsyncAskonceTransport
from askonce.integrations.requests import session
from http_raw import Canned
from stats_delta import delta

MODES = ["httpx", "httpx-async", "requests"]


@pytest.fixture(scope="module")
def canned() -> Iterator[Canned]:
    c = Canned()
    yield c
    c.close()


def policy() -> ClientPolicy:
    return ClientPolicy(layer="web", retry=RetryPolicy(attempts=3, backoff=NO_WAIT), bucket=None)


def get(mode: str, url: str, timeout: Any = 5.0) -> Any:
    """One GET through the askonce client of ``mode`` (no real waits: ``sleep`` does nothing)."""
    def no_wait(seconds: float) -> None:
        pass

    if mode == "httpx":
        with httpx.Client(transport=AskonceTransport(policy=policy(), sleep=no_wait), timeout=timeout) as c:
            return c.get(url)
    if mode == "httpx-async":
        async def go() -> httpx.Response:
            async def awaitable_no_wait(seconds: float) -> None:
                pass

            transport = AsyncAskonceTransport(policy=policy(), sleep=awaitable_no_wait)
            async with httpx.AsyncClient(transport=transport, timeout=timeout) as c:
                return await c.get(url)

        return asyncio.run(go())
    with session(policy(), sleep=no_wait) as s:
        return s.get(url, timeout=timeout)


def left() -> int:
    q = askonce.current()
    assert q is not None
    return q.budget


R = b"askonce-reply: "
BAD_REPLIES = [  # (name, header lines, counter: httpx, counter: requests (urllib3 joins repeated headers))
    ("duplicate", R + b"v=1, b=1\r\n" + R + b"v=1, b=1\r\n", "malformed.reply.duplicate-header",
     "malformed.reply.duplicate"),
    ("60kB", R + b"v=1, b=0, x=" + b"a" * 60_000 + b"\r\n", "malformed.reply.too-long", None),
    ("invalid-latin-1", R + b"v=1, b=0, dnr, r=\xff\xfe\r\n", "malformed.reply.not-ascii", None),
    ("budget-1e23", R + b"v=1, b=100000000000000000000000\r\n", "malformed.reply.syntax", None),
    ("negative-budget", R + b"v=1, b=-1, dnr\r\n", "malformed.reply.budget", None),
    ("unknown-version", R + b"v=9, b=0, dnr\r\n", "malformed.reply.version", None),
    ("empty", R + b"\r\n", "malformed.reply.version", None),
    ("parameters", R + b"v=1, b=0;x=1, dnr\r\n", "malformed.reply.syntax", None),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("name", "lines", "counter", "joined"), BAD_REPLIES, ids=[b[0] for b in BAD_REPLIES])
def test_a_reply_that_cannot_be_used_is_counted_and_read_as_no_reply(
        canned: Canned, mode: str, name: str, lines: bytes, counter: str, joined: str | None) -> None:
    counter = joined if mode == "requests" and joined else counter
    # On an answer: the callee said nothing usable, so all that was held comes back.
    canned.head = b"HTTP/1.1 200 OK\r\n" + lines
    before = askonce.stats()
    with askonce.question(budget=2):
        assert get(mode, canned.url()).status_code == 200
        assert left() == 2
    assert delta(before) == {counter: 1}
    # On a 503: no reply, so the retries spend the budget as for a callee that is not askonce-aware
    # (a malformed do-not-retry is not obeyed: it cannot be told from noise), and stop at 1 + budget.
    canned.head = b"HTTP/1.1 503 Service Unavailable\r\n" + lines
    canned.arrivals = 0
    before = askonce.stats()
    with askonce.question(budget=2):
        r = get(mode, canned.url())
        assert r.status_code == 503 and r.askonce_reply.reason == "exhausted"
        assert left() == 0
    assert canned.arrivals == 3
    assert delta(before)[counter] == 3


RETRY_AFTER = [  # (name, value, waits it out (retried), counted as malformed)
    ("huge-number", b"99999999999999999999", False, False),  # a day: past max_pushback, so the question ends
    ("far-date", b"Fri, 31 Dec 9999 23:59:59 GMT", False, False),
    ("negative", b"-5", True, True),
    ("garbage", b"soon", True, True),
    ("invalid-latin-1", b"\xff\xfe", True, True),
    ("year-99999", b"Mon, 01 Jan 99999 00:00:00 GMT", True, True),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("name", "value", "retried", "malformed"), RETRY_AFTER, ids=[r[0] for r in RETRY_AFTER])
def test_a_retry_after_that_cannot_be_used_never_crashes_and_is_counted(
        canned: Canned, mode: str, name: str, value: bytes, retried: bool, malformed: bool) -> None:
    canned.head = b"HTTP/1.1 503 Service Unavailable\r\nretry-after: " + value + b"\r\n" + R + b"v=1, b=2\r\n"
    canned.arrivals = 0
    before = askonce.stats()
    with askonce.question(budget=2):
        r = get(mode, canned.url())
    assert r.status_code == 503
    assert canned.arrivals == (3 if retried else 1)
    assert delta(before).get("malformed.retry-after", 0) == (canned.arrivals if malformed else 0)
    if not retried:
        assert (r.askonce_reply.dnr, r.askonce_reply.reason) == (True, "overloaded")


@pytest.mark.parametrize("mode", MODES)
def test_an_absurd_budget_in_a_reply_never_raises_the_callers_account(canned: Canned, mode: str) -> None:
    canned.head = b"HTTP/1.1 200 OK\r\n" + R + b"v=1, b=1000\r\n"
    with askonce.question(budget=2):
        assert get(mode, canned.url()).status_code == 200
        assert left() == 2  # never more than was held


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("timeout", [float("nan"), (float("nan"), 1.0), (1.0, float("nan"))],
                         ids=["nan", "connect-nan", "read-nan"])
def test_a_nan_timeout_is_refused_before_any_budget_is_held(canned: Canned, mode: str, timeout: Any) -> None:
    if mode != "requests" and isinstance(timeout, tuple):
        timeout = httpx.Timeout(5.0, connect=timeout[0], read=timeout[1])
    canned.head = b"HTTP/1.1 200 OK\r\n"
    canned.arrivals = 0
    with askonce.question(budget=2):
        with pytest.raises(ValueError):
            get(mode, canned.url(), timeout=timeout)
        assert left() == 2  # nothing was sent: nothing may be forfeit
    assert canned.arrivals == 0


@pytest.mark.parametrize("timeout", [(1.0,), (1.0, 2.0, 3.0)])
def test_requests_refuses_a_timeout_tuple_of_the_wrong_length_as_requests_does(canned: Canned, timeout: Any) -> None:
    with pytest.raises(ValueError, match="Invalid timeout"):
        requests.get(canned.url(), timeout=timeout)  # without askonce, for comparison
    with askonce.question(budget=2):
        with pytest.raises(ValueError, match="Invalid timeout"):
            get("requests", canned.url(), timeout=timeout)
        assert left() == 2


@pytest.mark.parametrize("mode", MODES)
def test_head_204_and_304_answers_are_answers(canned: Canned, mode: str) -> None:
    for status in (b"204 No Content", b"304 Not Modified"):
        canned.head = b"HTTP/1.1 " + status + b"\r\n" + R + b"v=1, b=1\r\n"
        with askonce.question(budget=2):
            r = get(mode, canned.url())
            assert r.status_code == int(status[:3])
            assert left() == 1  # the reply was read and settled
