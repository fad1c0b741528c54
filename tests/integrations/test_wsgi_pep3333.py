"""The WSGI middleware around a bare streaming app (``wsgi_apps.py``) under real waitress and wsgiref servers.

wsgiref runs the middleware inside ``wsgiref.validate.validator``, which turns any breach of PEP 3333 by
the middleware (a header added after ``start_response`` was sent, a second ``start_response`` without
``exc_info``, an iterable never closed) into an error the test sees. Requests are written on raw
sockets, so that header bytes arrive exactly as written (duplicates, invalid latin-1, 60 kB values).
Checked: question headers that cannot be used, give-ups from streaming bodies before and after the
headers went out, HEAD and bodiless statuses, the legacy ``write()`` callable, and ``close()``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server
from wsgiref.validate import validator

import pytest

import askonce
from askonce import Reply
from askonce.integrations.wsgi import AskonceWSGIMiddleware
from e2e_services import waitress_running
from http_raw import q, raw
from stats_delta import delta
from wsgi_apps import GOOD, KEY, Closes, make_app

SERVERS = ["waitress", "wsgiref"]


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Server(WSGIServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that closed early; the app's errors are caught by the handler below


@contextlib.contextmanager
def wsgiref_running(app: Any) -> Iterator[tuple[str, list[str]]]:
    """wsgiref with the PEP 3333 validator around ``app``; yields the URL and the errors it logged."""
    errors: list[str] = []

    class Handler(_Quiet):
        def get_stderr(self) -> Any:
            class Sink:
                def write(self, text: str) -> None:
                    errors.append(text)

                def writelines(self, lines: Iterable[str]) -> None:
                    errors.extend(lines)

                def flush(self) -> None:
                    pass

            return Sink()

    server = make_server("127.0.0.1", 0, validator(app), server_class=_Server, handler_class=Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", errors
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


class Running:
    def __init__(self, name: str, url: str, errors: list[str], closes: Closes) -> None:
        self.name = name
        self.url = url
        self.errors = errors  # what wsgiref logged (the validator's complaints among them)
        self.closes = closes
        self.seen = 0

    def new_errors(self) -> list[str]:
        """What the server logged since the last call."""
        new, self.seen = self.errors[self.seen:], len(self.errors)
        return new

    def closed(self, path: str) -> bool:
        """Whether the server closed the body of a request to ``path`` (it may do so after the response)."""
        limit = time.monotonic() + 5
        while path not in self.closes.paths:
            if time.monotonic() > limit:
                return False
            time.sleep(0.01)
        return True


@pytest.fixture(scope="module", params=SERVERS)
def served(request: pytest.FixtureRequest) -> Iterator[Running]:
    closes = Closes()
    mw = AskonceWSGIMiddleware(make_app(closes), layer="svc")
    if request.param == "waitress":
        with waitress_running(mw) as url:
            yield Running("waitress", url, [], closes)
    else:
        with wsgiref_running(mw) as (url, errors):
            yield Running("wsgiref", url, errors, closes)


# (name, header lines, the counter it must bump)
UNUSABLE = [
    ("60kB", q("v=1, x=" + "a" * 60_000), "malformed.question.too-long"),
    ("duplicate", q(GOOD) + q(GOOD), "malformed.question.duplicate"),
    ("invalid-latin-1", q(b'v=1, k="\xff\xfe\x80' + KEY.encode() + b'", o=edge, b=2'), "malformed.question.not-ascii"),
    ("utf-8", q('v=1, k="cl\u00e9", o=edge, b=2'.encode()), "malformed.question.not-ascii"),
    ("empty", q(""), "malformed.question.version"),
    ("unknown-version", q(f'v=9, k="{KEY}", o=edge, b=2'), "malformed.question.version"),
    ("budget-1e30", q(f'v=1, k="{KEY}", o=edge, b={10**30}'), "malformed.question.syntax"),
    ("negative-budget", q(f'v=1, k="{KEY}", o=edge, b=-3'), "malformed.question.budget"),
    ("deadline-1e12", q(f'v=1, k="{KEY}", o=edge, b=2, d={10**12}'), "malformed.question.deadline"),
    ("negative-deadline", q(f'v=1, k="{KEY}", o=edge, b=2, d=-1'), "malformed.question.deadline"),
    ("decimal-deadline", q(f'v=1, k="{KEY}", o=edge, b=2, d=1.5'), "malformed.question.syntax"),
]


@pytest.mark.parametrize(("name", "header", "counter"), UNUSABLE, ids=[u[0] for u in UNUSABLE])
def test_a_question_header_that_cannot_be_used_is_counted_and_the_request_answered(
        served: Running, name: str, header: bytes, counter: str) -> None:
    before = askonce.stats()
    r = raw(served.url, "/ok", header)
    assert r.status == 200, r.body
    assert r.reply == Reply(2)  # the budget this layer minted, untouched
    key, budget, origin = r.body.split(b"\n")[0].split()
    assert (budget, origin) == (b"2", b"svc") and key != KEY.encode()  # minted here, as if nothing came
    assert delta(before) == {counter: 1}
    assert served.new_errors() == []


def test_absurd_budgets_and_deadlines_within_the_protocol_are_clamped(served: Running) -> None:
    r = raw(served.url, "/ok", q(f'v=1, k="{KEY}", o=edge, e, b=1000, d=86400000'))
    assert r.status == 200
    assert r.body.split(b"\n")[0] == f"{KEY} 10 edge".encode()  # Limits() default: 10
    assert r.reply == Reply(10)


def test_distinct_malformed_headers_add_no_new_counters(served: Running) -> None:
    raw(served.url, "/ok", q("v=1, k=nope-0"))
    names = set(askonce.stats())
    for i in range(40):
        raw(served.url, "/ok", q(f"v=1, k=nope-{i}, z{i}={i}"))
    assert set(askonce.stats()) == names  # counter names come from a fixed set, not from the input


# --- streaming bodies, HEAD, 204/304, close() ----------------------------------------------------------


@pytest.mark.parametrize("path", ["/lazy-give-up", "/started-give-up", "/empty-then-give-up"])
def test_a_give_up_raised_by_a_streaming_body_before_any_byte_went_out_becomes_503(served: Running,
                                                                                  path: str) -> None:
    before = askonce.stats()
    r = raw(served.url, path, q(GOOD))
    if served.name == "wsgiref" and path == "/empty-then-give-up":
        # wsgiref sends the headers with an empty chunk (PEP 3333 says not to): the 200 is out, and the
        # second start_response (with exc_info) re-raises, so the response is cut as without askonce
        assert (r.status, r.reply) == (200, Reply(2))
        assert served.closed(path)
        served.new_errors()
        assert delta(before) == {"server.gave-up.unsent": 1}  # not counted as a 503 that never went out
        return
    assert r.status == 503, r.body
    assert r.reply == Reply(0, True, "exhausted")
    assert r.body == b"askonce: exhausted\n"
    assert delta(before).get("server.gave-up.exhausted") == 1
    assert served.closed(path)
    assert served.new_errors() == []


def test_a_plain_error_of_a_streaming_body_before_any_byte_is_left_to_the_server(served: Running) -> None:
    r = raw(served.url, "/lazy-bug", q(GOOD))
    assert r.status == 500  # the server's own error response, as for any app
    assert served.closed("/lazy-bug")
    served.new_errors()  # wsgiref logs the bug


def test_a_give_up_after_the_headers_went_out_cuts_the_response_without_touching_its_headers(
        served: Running) -> None:
    r = raw(served.url, "/midstream-give-up", q(GOOD))
    assert r.status == 200
    assert r.reply == Reply(2)  # the headers as they were sent: no second start_response
    assert b"end" not in r.body
    if served.name == "waitress":  # chunked: the cut shows (wsgiref's HTTP/1.0 body just ends)
        assert not r.complete
    assert served.closed("/midstream-give-up")
    assert not any("Headers already" in e or "AssertionError" in e for e in served.new_errors())


@pytest.mark.parametrize(("path", "status"), [("/ok", 200), ("/no-content", 204), ("/not-modified", 304)])
def test_head_and_bodiless_statuses_carry_the_reply_and_no_body(served: Running, path: str, status: int) -> None:
    for method in (b"GET", b"HEAD"):
        r = raw(served.url, path, q(GOOD), method=method)
        assert r.status == status
        assert r.reply == Reply(2)
        if status != 200:  # (a HEAD's body is the server's to drop: waitress leaves it to the app)
            assert r.body == b""
    assert served.new_errors() == []


def test_the_legacy_write_callable_gets_the_reply_header(served: Running) -> None:
    r = raw(served.url, "/write", q(GOOD))
    assert r.status == 200
    assert r.reply == Reply(2)
    assert b"written" in r.body and b"returned" in r.body
    assert served.new_errors() == []


@pytest.mark.parametrize("path", ["/write-then-give-up", "/write-then-raise"])
def test_a_give_up_after_write_sent_the_headers_cuts_the_response(served: Running, path: str) -> None:
    before = askonce.stats()
    r = raw(served.url, path, q(GOOD))
    assert (r.status, r.reply) == (200, Reply(2))  # the server refused the 503: its headers were out
    assert r.body.startswith(b"written") and b"returned" not in r.body
    if path == "/write-then-give-up":
        assert served.closed(path)
    assert "server.gave-up.exhausted" not in delta(before)
    assert delta(before).get("server.gave-up.unsent") == 1
    assert not any("AssertionError" in e for e in served.new_errors())


def _one_chunk(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
    start_response("200 OK", [("content-type", "text/plain")])
    return [b"hello"]


@pytest.mark.parametrize("method", [b"GET", b"HEAD"])
def test_a_one_chunk_body_keeps_the_content_length_the_server_gives_it(method: bytes) -> None:
    """PEP 3333 servers size a body of one item themselves; wrapping it must not turn that into chunking."""
    framing = []
    for app in (_one_chunk, AskonceWSGIMiddleware(_one_chunk, layer="svc")):
        with waitress_running(app) as url:
            r = raw(url, "/", method=method)
        framing.append((r.all("content-length"), r.all("transfer-encoding")))
    assert framing[0] == framing[1] == (["5"], [])


def test_every_body_the_app_returned_is_closed(served: Running) -> None:
    paths = ["/ok", "/midstream-give-up", "/started-give-up", "/write", "/no-content"]
    before = {path: served.closes.paths.count(path) for path in paths}  # earlier tests closed some already
    for path in paths:
        raw(served.url, path, q(GOOD))
    for path in paths:
        assert served.closed(path)
        assert served.closes.paths.count(path) == before[path] + 1, path  # this request's body, once
