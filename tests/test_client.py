"""askonce.client: the shared client shell, driven against a real HTTP server on 127.0.0.1.

The server here (``Target``) is also what ``test_httpx.py`` and ``test_requests.py`` call. It counts
arrivals per question key and behaves by path:

    /ok             200                    /fail/N    503 for the first N arrivals of a key, then 200
    /fail           503 always             /flaky     503 for 10 % of arrivals (seeded), else 200
    /status/S       status S               /after/S   503 with Retry-After: S on a key's first arrival
    /dnr            503 + do-not-retry     /close     closes the connection without a response
    /slow           waits (up to 5 s, released at teardown), then 200
    /t429           429 with Retry-After: 1 on a key's first arrival, then 200

It answers as an askonce-aware target (``askonce-reply`` with the budget it was given, nothing spent)
unless the query has ``plain``.
"""

from __future__ import annotations

import contextvars
import http.client
import socket
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import pytest

import askonce
from askonce import NO_WAIT, Question, Reply, RetryPolicy
from askonce.client import (
    LOST_OUTCOME,
    REFUSED_OUTCOME,
    Caller,
    ClientPolicy,
    Outcome,
    is_idempotent,
    judge_http,
    last_reply,
    parse_retry_after,
    replies,
)
from askonce.core import wire
from askonce.core.breaker import BreakerPolicy
from askonce.core.wire import REPLY_HEADER, format_reply
from askonce.stores.memory import MemoryStore

# --- the target ---------------------------------------------------------------------------------------


class Target:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.release = threading.Event()
        self.reset()
        target = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, so released connections can be seen being reused
            disable_nagle_algorithm = True  # headers and body go out in two writes: no delayed-ACK stalls

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                target.handle(self)

            do_POST = do_PUT = do_PATCH = do_DELETE = do_GET

        class Server(ThreadingHTTPServer):
            def handle_error(self, request: Any, client_address: Any) -> None:
                if not isinstance(sys.exc_info()[1], OSError):  # a client that gave up is what tests do
                    super().handle_error(request, client_address)

        self.server = Server(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def reset(self) -> None:
        with self.lock:
            self.arrivals: Counter[str | None] = Counter()
            self.seen: list[Question | None] = []
            self.raw: list[str | None] = []
            self.ports: list[int] = []
            self.flaky = __import__("random").Random(7)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    @property
    def total(self) -> int:
        return sum(self.arrivals.values())

    def handle(self, h: BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        if length:
            h.rfile.read(length)
        elif h.headers.get("Transfer-Encoding") == "chunked":
            while (size := int(h.rfile.readline().strip() or b"0", 16)) > 0:
                h.rfile.read(size + 2)
            h.rfile.readline()
        url = urlsplit(h.path)
        kind, _, arg = url.path.strip("/").partition("/")
        q = askonce.extract(h.headers)
        key = None if q is None else q.key
        with self.lock:
            self.arrivals[key] += 1
            n = self.arrivals[key]
            self.seen.append(q)
            self.raw.append(h.headers.get("askonce-question"))
            self.ports.append(h.client_address[1])
            unlucky = self.flaky.random() < 0.1
        status, headers = 200, {}
        if kind == "close":
            h.close_connection = True
            return
        if kind == "slow":
            self.release.wait(5.0)
        elif kind == "fail":
            status = 503 if not arg or n <= int(arg) else 200
        elif kind == "flaky":
            status = 503 if unlucky else 200
        elif kind == "status":
            status = int(arg)
        elif kind == "after" and n == 1:
            status, headers = 503, {"Retry-After": arg}
        elif kind == "t429" and n == 1:
            status, headers = 429, {"Retry-After": "1"}
        budget = 0 if q is None else q.budget
        if kind == "dnr":
            status, headers = 503, {REPLY_HEADER: format_reply(Reply(budget, True, "overloaded"))}
        elif "plain" not in url.query:
            headers.setdefault(REPLY_HEADER, format_reply(Reply(budget)))
        body = b"ok" if status < 400 else b"no" * 10
        h.send_response(status)
        for name, value in headers.items():
            h.send_header(name, value)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


@pytest.fixture(scope="module")
def _server() -> Iterator[Target]:
    t = Target()
    yield t
    t.close()


@pytest.fixture
def target(_server: Target) -> Target:
    _server.reset()
    return _server


def refused_url() -> str:
    """A URL nothing listens on: connecting is refused."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port: int = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}/ok"


def policy(**kw: Any) -> ClientPolicy:
    """A client layer "web" trying 3 times with no waits and no token bucket, unless told otherwise."""
    retry = kw.pop("retry", RetryPolicy(attempts=3, backoff=NO_WAIT))
    return ClientPolicy(**{"layer": "web", "retry": retry, "bucket": None, **kw})


# --- a third client, on http.client, to drive the Caller the way an integration does ----------------


class StdlibExchange:
    """One GET through ``http.client``: the smallest possible integration."""

    def __init__(self, p: ClientPolicy, url: str, timeout: float | None = 5.0) -> None:
        self.policy = p
        self.parts = urlsplit(url)
        self.timeout = timeout

    def send(self, header: str, timeout: float | None) -> tuple[int, http.client.HTTPMessage]:
        conn = http.client.HTTPConnection(self.parts.hostname or "", self.parts.port, timeout=timeout)
        try:
            try:
                conn.connect()
            except OSError as e:
                raise ConnectionRefusedError(str(e)) from e
            path = self.parts.path + ("?" + self.parts.query if self.parts.query else "")
            conn.request("GET", path, headers={"askonce-question": header})
            resp = conn.getresponse()
            resp.read()
            return resp.status, resp.headers
        finally:
            conn.close()

    def judge(self, response: tuple[int, http.client.HTTPMessage]) -> Outcome:
        return judge_http(self.policy, response[0], response[1])

    def judge_error(self, error: Exception) -> Outcome | None:
        if isinstance(error, ConnectionRefusedError):
            return REFUSED_OUTCOME
        if isinstance(error, OSError | http.client.HTTPException):
            return LOST_OUTCOME
        return None

    def discard(self, response: object) -> None:
        pass


def call(p: ClientPolicy, url: str, **caller: Any) -> Any:
    return Caller(p, **caller).call(StdlibExchange(p, url), target="t")


# --- the pieces ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("5", 5.0),
        (" 0 ", 0.0),
        (b"12", 12.0),
        ("90000", 86_400.0),  # bounded to a day
        ("9" * 40, 86_400.0),
        (formatdate(1_000_010.0, usegmt=True), 10.0),  # an HTTP-date ten seconds after `wall`
        (formatdate(999_000.0, usegmt=True), 0.0),  # in the past: no wait
        ("soon", None),
        ("-1", None),
        ("1.5", None),
        ("", None),
        ("\u0661", None),  # a non-ASCII digit
        ("x" * 100, None),
        (None, None),
    ],
)
def test_retry_after_is_seconds_or_an_http_date_bounded(value: str | bytes | None, expected: float | None) -> None:
    assert parse_retry_after(value, wall=1_000_000.0) == expected


def test_a_malformed_retry_after_is_counted() -> None:
    before = askonce.stats().get("malformed.retry-after", 0)
    assert parse_retry_after("tomorrow-ish") is None
    assert askonce.stats()["malformed.retry-after"] == before + 1


@pytest.mark.parametrize(
    ("status", "headers", "failure", "retryable", "health"),
    [
        (200, {}, False, None, True),
        (404, {}, False, None, None),  # an answer; says nothing about the target's health
        (500, {}, True, False, False),
        (502, {}, True, True, False),
        (503, {}, True, True, False),
        (504, {}, True, True, False),
        (429, {}, True, False, False),  # throttled with no word on when to come back: not retried
        (429, {"retry-after": "2"}, True, True, False),
    ],
)
def test_judging_http_responses(status: int, headers: dict[str, str], failure: bool, retryable: bool | None,
                                health: bool | None) -> None:
    outcome = judge_http(ClientPolicy(), status, headers)
    assert (outcome.failure is not None) is failure and outcome.health is health
    if outcome.failure is not None:
        assert outcome.failure.retryable is retryable and outcome.failure.delivery == "answered"
        assert outcome.failure.retry_after == (2.0 if headers else None)


def test_the_reply_is_read_from_any_response() -> None:
    outcome = judge_http(ClientPolicy(), 503, {"askonce-reply": "v=1, b=0, dnr, r=overloaded, pb=250"})
    assert outcome.reply == Reply(0, True, "overloaded", 0.25)
    assert outcome.failure is not None and outcome.failure.reply == outcome.reply


@pytest.mark.parametrize(
    ("method", "headers", "kw", "expected"),
    [
        ("GET", {}, {}, True),
        ("put", {}, {}, True),
        ("POST", {}, {}, False),
        ("PATCH", {}, {}, False),
        ("POST", {"Idempotency-Key": "abc"}, {}, True),
        ("POST", {"Idempotency-Key": "abc"}, {"idempotency_header": None}, False),
        ("POST", {}, {"retry_non_idempotent": True}, True),
        ("GET", {}, {"idempotent_methods": frozenset({"head"})}, False),
    ],
)
def test_what_may_be_repeated(method: str, headers: dict[str, str], kw: dict[str, Any], expected: bool) -> None:
    assert is_idempotent(ClientPolicy(**kw), method, headers) is expected


@pytest.mark.parametrize(
    "kw",
    [
        {"layer": "no spaces"},
        {"layer": ""},
        {"retry_statuses": frozenset({700})},
        {"retry_statuses": frozenset({True})},
        {"idempotent_methods": frozenset({"G ET"})},
        {"idempotency_header": "Idem Key"},
        {"attempt_timeout": 0},
        {"attempt_timeout": -1.0},
        {"max_discard": -1},
        {"retry": 3},
        {"bucket": 0.1},
        {"breaker": "on"},
    ],
)
def test_bad_policies_are_refused(kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        ClientPolicy(**kw)


def test_policy_sets_are_normalised() -> None:
    p = ClientPolicy(retry_statuses={503}, idempotent_methods={"get"})  # type: ignore[arg-type]
    assert p.retry_statuses == frozenset({503}) and p.idempotent_methods == frozenset({"GET"})
    hash(p)


# --- the Caller against a real server -------------------------------------------------------------------


def test_a_failing_target_sees_one_plus_budget_arrivals_and_one_key(target: Target) -> None:
    p = policy(retry=RetryPolicy(attempts=10, backoff=NO_WAIT))
    for _ in range(5):
        with askonce.question(budget=2) as q:
            status, _ = call(p, target.url("/fail"))
        assert status == 503
        assert target.arrivals[q.key] == 3
    assert len(target.arrivals) == 5
    assert [tuple(map(str, s.path)) for s in target.seen[:3] if s] == [("web:1",), ("web:2",), ("web:3",)]


def test_a_give_up_with_a_response_returns_it_and_records_the_reply(target: Target) -> None:
    p = policy()
    with askonce.question(budget=1), replies():
        status, _ = call(p, target.url("/fail"))
        assert status == 503
        assert last_reply() == Reply(0, True, "exhausted")
    assert target.total == 2


def test_replies_sees_give_ups_made_in_threads_started_inside(target: Target) -> None:
    p = policy()
    with askonce.question(budget=2), replies():
        ctx = contextvars.copy_context()
        worker = threading.Thread(target=ctx.run, args=(call, p, target.url("/dnr")))
        worker.start()
        worker.join(10)
        reply = last_reply()
    assert reply is not None and reply.dnr and reply.reason == "overloaded"
    assert target.total == 1


def test_without_a_bound_question_each_call_mints_its_own(target: Target) -> None:
    call(policy(), target.url("/ok"))
    call(policy(originator=True), target.url("/ok"))
    local, edge = target.seen
    assert local is not None and edge is not None and local.key != edge.key
    assert (local.origin, local.edge, edge.edge) == ("web", False, True)
    assert local.budget == edge.budget == 2


def test_refused_gives_up_with_the_original_error_and_spends_only_our_own_retries() -> None:
    with askonce.question(budget=5), pytest.raises(ConnectionRefusedError) as info:
        call(policy(), refused_url())
    assert info.value.askonce_reply == Reply(3)  # type: ignore[attr-defined]  # 5 - 2 retries, nothing held


def test_no_first_attempt_past_the_deadline(target: Target) -> None:
    now = [0.0]
    with askonce.question(budget=2, deadline=1.0):
        now[0] = 10.0 + askonce.context.monotonic()
        with pytest.raises(askonce.DeadlineExceeded):
            call(policy(), target.url("/ok"), clock=lambda: now[0])
    assert target.total == 0


def test_an_unknown_error_while_sending_fails_closed_and_passes_through(target: Target) -> None:
    class Broken(StdlibExchange):
        def send(self, header: str, timeout: float | None) -> tuple[int, http.client.HTTPMessage]:
            super().send(header, timeout)
            raise KeyError("bug in the integration")

    p = policy()
    with askonce.question(budget=2):
        with pytest.raises(KeyError):
            Caller(p).call(Broken(p, target.url("/ok")), target="t")
        current = askonce.current()
    assert current is not None and current.budget == 0  # the callee may have spent what it was given
    assert target.total == 1


def test_the_token_bucket_throttles_retries_per_target(target: Target) -> None:
    p = policy(retry=RetryPolicy(attempts=5, backoff=NO_WAIT),
               bucket=askonce.BucketPolicy(ratio=0.0, floor=1.0, max_tokens=0))
    store = MemoryStore(lambda: 0.0)
    with askonce.question(budget=5):
        status, _ = call(p, target.url("/fail"), store=store, clock=lambda: 0.0)
    assert status == 503 and target.total == 2  # the one floor token: one retry


needs_breakers = pytest.mark.skipif(not hasattr(MemoryStore, "breaker"),
                                    reason="MemoryStore.breaker() is not there yet (added in parallel)")


@needs_breakers
def test_an_open_breaker_refuses_the_call_without_an_arrival(target: Target) -> None:
    p = policy(breaker=BreakerPolicy(window_size=2, minimum_calls=2, failure_rate=0.5, open_for=30.0))
    store = MemoryStore(lambda: 0.0)
    with askonce.question(budget=1):
        status, _ = call(p, target.url("/fail"), store=store, clock=lambda: 0.0)  # two failures: open
    assert status == 503 and target.total == 2
    with askonce.question(budget=1), pytest.raises(askonce.CircuitOpen) as info:
        call(p, target.url("/ok"), store=store, clock=lambda: 1.0)
    assert target.total == 2
    assert info.value.retry_at == 30.0 and info.value.reply.reason == "breaker-open"


def test_a_breaker_needs_a_store_that_has_breakers() -> None:
    class BucketsOnly:
        def bucket(self, target: str, policy: askonce.BucketPolicy) -> Any:
            raise AssertionError

    with pytest.raises(ValueError, match="breaker"):
        Caller(ClientPolicy(breaker=BreakerPolicy()), store=BucketsOnly())


def test_importing_the_client_and_the_integrations_package_imports_no_framework_and_not_asyncio() -> None:
    code = ("import sys, askonce.client, askonce.integrations; "
            "print(sorted(m for m in ('httpx', 'requests', 'urllib3', 'asyncio') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


# --- the first attempt's fast path and the general loop agree ---------------------------------------------


class Scripted:
    """An in-process exchange: each attempt answers with the next (status, reply) of a script."""

    timeout = None

    def __init__(self, p: ClientPolicy, script: list[tuple[int, Reply | None]]) -> None:
        self.policy, self.script, self.headers = p, list(script), []  # type: list[str]

    def send(self, header: str, timeout: float | None) -> tuple[int, Reply | None]:
        self.headers.append(header)
        return self.script.pop(0)

    def judge(self, response: tuple[int, Reply | None]) -> Outcome:
        status, reply = response
        return judge_http(self.policy, status, {} if reply is None else {REPLY_HEADER: format_reply(reply)})

    def judge_error(self, error: Exception) -> Outcome | None:
        return None

    def discard(self, response: object) -> None:
        pass


@needs_breakers
@pytest.mark.parametrize("script", [
    [(200, Reply(1))],                      # the callee spent one of the two forwarded
    [(200, None)],                          # a callee that says nothing spent nothing of ours
    [(503, Reply(2)), (200, Reply(2))],     # one retry, then the answer
    [(503, Reply(0, True, "exhausted"))],   # a do-not-retry passed on
    [(503, Reply(2))] * 3,                  # attempts used up
])
def test_the_fast_path_decides_as_the_general_loop_does(script: list[tuple[int, Reply | None]]) -> None:
    # A breaker sends every call through the general loop (a generator over RetryState) from the first
    # attempt; without one, the first attempt is made straight. Both must end the same way.
    outcomes = []
    for breaker in (None, BreakerPolicy(window_size=100, minimum_calls=100)):
        p = policy(breaker=breaker, retry=RetryPolicy(attempts=3, backoff=NO_WAIT))
        exchange = Scripted(p, script)
        with askonce.question(budget=3), replies():
            status, _ = Caller(p, store=MemoryStore(lambda: 0.0), clock=lambda: 0.0).call(exchange, target="t")
            left = askonce.current()
            outcomes.append((status, left.budget if left else None, last_reply(), exchange.headers))
    assert outcomes[0][:3] == outcomes[1][:3]

    def sent(headers: list[str]) -> list[tuple[int, str]]:  # what each attempt forwarded, and its path
        return [(q.budget, str(q.path[-1])) for q in (wire.parse_question(h, 0.0) for h in headers)
                if isinstance(q, Question)]

    assert sent(outcomes[0][3]) == sent(outcomes[1][3]) and len(outcomes[0][3]) == len(outcomes[1][3])


def test_an_interruption_during_the_first_attempt_fails_closed() -> None:
    import asyncio

    class Interrupted:
        timeout = None

        async def send(self, header: str, timeout: float | None) -> None:
            raise asyncio.CancelledError  # e.g. the request's task cancelled while it waits for the answer

        def judge(self, response: object) -> Outcome:
            raise AssertionError

        def judge_error(self, error: Exception) -> Outcome | None:
            raise AssertionError("a cancellation is not a transport failure")

        async def discard(self, response: object) -> None: ...

    async def go() -> askonce.Question | None:
        with askonce.question(budget=2):
            with pytest.raises(asyncio.CancelledError):
                await Caller(policy()).acall(Interrupted(), target="t")
            return askonce.current()

    left = asyncio.run(go())
    assert left is not None and left.budget == 0  # forwarded, never answered: counted as spent


# --- reading replies ---------------------------------------------------------------------------------------


def test_replies_read_through_the_cache_are_what_the_parser_says() -> None:
    from askonce import context
    from askonce.client import read_reply, reply_from

    values = ["v=1, b=2", "v=1, b=0, dnr, r=overloaded, pb=250", b"v=1, b=7", "v=1, b=1, dnr, r=cap"]
    for _ in range(2):  # the second time from the cache
        for value in values:
            assert read_reply({REPLY_HEADER: value}) == context.extract_reply({REPLY_HEADER: value})
            assert reply_from([value]) == context.extract_reply({REPLY_HEADER: value})
    assert reply_from([]) is None and read_reply({}) is None


@pytest.mark.parametrize(("values", "counted"), [
    (["v=1, b=nope"], "malformed.reply.budget"),
    (["v=1, b=1,"], "malformed.reply.syntax"),
    (["v=2, b=1"], "malformed.reply.version"),
    (["v=1, b=1", "v=1, b=1"], "malformed.reply.duplicate-header"),
])
def test_a_malformed_reply_is_counted_every_time_never_cached(values: list[str], counted: str) -> None:
    from askonce.client import reply_from

    before = askonce.stats().get(counted, 0)
    for _ in range(3):
        assert reply_from(values) is None
    assert askonce.stats()[counted] == before + 3


def test_the_reply_cache_is_bounded() -> None:
    from askonce.client_policy import _MAX_CACHED_REPLIES, _REPLIES, reply_from

    for budget in range(1000):
        assert reply_from([f"v=1, b={budget}, pb={budget}"]) == Reply(budget, False, None, budget / 1000)
    long = "v=1, b=1000, dnr, r=" + "x" * 32 + ", pb=86400000"
    assert len(long) > 64 and reply_from([long]) == Reply(1000, True, "x" * 32, 86_400.0)
    assert len(_REPLIES) <= _MAX_CACHED_REPLIES and long not in _REPLIES


# --- recording give-ups without a with-block ----------------------------------------------------------------


def test_record_replies_starts_a_record_that_stop_recording_ends(target: Target) -> None:
    from askonce.client import Record, record_replies, recording, stop_recording

    outer = record_replies()
    mine = Record()
    inner = record_replies(mine)
    assert recording() is mine
    with askonce.question(budget=0):
        status, _ = call(policy(), target.url("/fail"))
    assert status == 503 and mine.last == Reply(0, True, "exhausted") and last_reply() == mine.last
    stop_recording(inner)
    assert recording() is not mine and last_reply() is None  # the outer record saw nothing
    stop_recording(outer)
