"""The WSGI middleware keeps what callers and callees choose (reasons, pushbacks, keys and paths) within
bounds: counter names, header values, memory. Real waitress servers on 127.0.0.1; the app is
``wsgi_apps.py``'s, the raw HTTP helpers ``http_raw``'s.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterable
from typing import Any

import httpx
import pytest

import askonce
from askonce import Reply, RetryPolicy
from askonce.client import ClientPolicy
from askonce.core import wire
from askonce.integrations.httpx import AskonceTransport
from askonce.integrations.wsgi import AskonceWSGIMiddleware
from e2e_services import waitress_running
from http_raw import Canned, q, raw
from wsgi_apps import GOOD, KEY, Closes, make_app

# --- counters named after what a callee said ----------------------------------------------------------


def test_reasons_a_downstream_makes_up_add_no_new_counters() -> None:
    downstream = Canned()
    http = httpx.Client(transport=AskonceTransport(policy=ClientPolicy(
        layer="svc", retry=RetryPolicy(attempts=1), bucket=None)), timeout=5.0)

    def relay(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        r = http.get(downstream.url())  # gives up on the callee's do-not-retry; the app answers 502
        start_response("502 Bad Gateway" if r.status_code >= 500 else "200 OK", [("content-type", "text/plain")])
        return [b"relayed\n"]

    try:
        with waitress_running(AskonceWSGIMiddleware(relay, layer="svc")) as url:
            names = set(askonce.stats())
            for i in range(30):
                downstream.head = f"HTTP/1.1 503 Busy\r\naskonce-reply: v=1, b=2, dnr, r=made-up-{i}\r\n".encode()
                r = raw(url, "/relay", q(GOOD))
                assert (r.status, r.reply.reason) == (503, f"made-up-{i}")  # passed on, as it should be
            grown = {n for n in set(askonce.stats()) - names if n.startswith("server.gave-up.")}
            assert len(grown) <= len(wire.REASONS) + 1
    finally:
        http.close()
        downstream.close()


# --- a give-up the app builds with a pushback out of range ---------------------------------------------


def _pushing_back(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
    pushback = float(environ["PATH_INFO"].strip("/"))
    raise askonce.DoNotRetry("busy", reply=Reply(0, True, "overloaded", pushback), layer="svc", key=None, attempts=1)


# inf, nan and 1e12 are clamped: the answer is the middleware's 503 (not the server's bare 500), and both its
# pb and its Retry-After say at most a day.
@pytest.mark.parametrize("pushback", ["inf", "nan", "1e12", "2.5"])
def test_a_pushback_the_app_puts_in_a_give_up_is_answered_within_the_protocol(pushback: str) -> None:
    with waitress_running(AskonceWSGIMiddleware(_pushing_back, layer="svc")) as url:
        r = raw(url, "/" + pushback, q(GOOD))
    assert r.status == 503
    assert (r.reply.dnr, r.reply.reason) == (True, "overloaded")
    assert r.reply.pushback is not None and 0 <= r.reply.pushback <= wire.MAX_DEADLINE_MS / 1000
    (retry_after,) = r.all("retry-after")
    assert 0 <= int(retry_after) <= 86_400


def test_distinct_questions_by_the_thousand_leave_memory_where_it_was() -> None:
    """Keys, paths and malformed values chosen by callers: whatever is cached of them stays bounded."""
    class Uncounted(Closes):
        def add(self, path: str) -> None:
            pass  # the list of closes would grow itself

    mw = AskonceWSGIMiddleware(make_app(Uncounted()), layer="svc")

    def request(i: int) -> None:
        hops = " ".join(f"l{i}-{j}:{1 + j}" for j in range(4))
        value = (f'v=1, k="{KEY[:-6]}{i:06d}", o=o{i}, e, b=2, d=5000, p=({hops})' if i % 3 else
                 f"v=1, k=nope, z{i}={i}")
        environ = {"REQUEST_METHOD": "GET", "PATH_INFO": "/ok", "HTTP_ASKONCE_QUESTION": value}
        body = mw(environ, lambda status, headers, exc_info=None: lambda data: None)
        for _ in body:
            pass
        body.close()  # type: ignore[attr-defined]

    for i in range(600):  # fill what is cached to its bound
        request(i)
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for i in range(600, 9600):
            request(i)
        grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename"))
    finally:
        tracemalloc.stop()
    assert grown < 512 * 1024, grown  # the caches refill to their bounds (~200 kB); a leak of 60 B a request fails
