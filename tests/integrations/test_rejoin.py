"""A timed-out try toward a callee that joins is retried, and the retry joins the work in flight.

Real servers on 127.0.0.1 (uvicorn for ASGI, waitress for WSGI) behind ``AskonceASGIMiddleware``
or ``AskonceWSGIMiddleware`` with a ledger; the client is the httpx transport with a per-attempt
timeout shorter than the handler's first run. The handler counts its runs (its side effect) per
question key; the ledger counts every arrival.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

import askonce
from askonce.client import JOINERS, ClientPolicy
from askonce.core.ledger import Ledger, LedgerPolicy
from askonce.core.wire import REPLY_HEADER, Reply, parse_reply
from askonce.integrations.asgi import AskonceASGIMiddleware
from askonce.integrations.asgi_join import JoinASGIMiddleware
from askonce.integrations.httpx import AskonceTransport, default_target
from askonce.integrations.wsgi import AskonceWSGIMiddleware
from askonce.integrations.wsgi_join import JoinWSGIMiddleware
from askonce.propagation import new_key
from e2e_services import uvicorn_running, waitress_running
from stats_delta import delta

SLOW = 0.8  # seconds the first run of a question takes: longer than the client's attempt timeout
TIMEOUT = 0.3  # the client's per-attempt timeout


class Work:
    """The handler's side effect: runs per question key (the first run of each key is slow)."""

    def __init__(self) -> None:
        self.runs: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.released = threading.Event()  # ends a run of ``/hold`` (at most 10 s)

    def run(self, path: str) -> float:
        """Count a run; how long it takes (``/warm`` and ``/hold`` are never slow)."""
        q = askonce.current()
        key = q.key if q is not None else "-"
        with self.lock:
            self.runs[key] += 1
            first = self.runs[key] == 1
        return SLOW if first and path not in ("/warm", "/hold") else 0.0


def asgi_app(work: Work) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        while (await receive()).get("more_body", False):
            pass
        await asyncio.sleep(work.run(scope["path"]))
        for _ in range(1000 if scope["path"] == "/hold" else 0):
            if work.released.is_set():
                break
            await asyncio.sleep(0.01)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"done"})

    return app


def wsgi_app(work: Work) -> Any:
    def app(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
        time.sleep(work.run(environ["PATH_INFO"]))
        if environ["PATH_INFO"] == "/hold":
            work.released.wait(10.0)
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"done"]

    return app


DAY = 86_400.0  # one ledger window for the whole run: no window boundary in the middle of a test


@contextmanager
def callee(kind: str, join: bool, policy: LedgerPolicy = LedgerPolicy(window=DAY),
           **options: Any) -> Iterator[tuple[str, Work, Ledger]]:
    """The callee; ``options``: more of the askonce middleware's (``concurrency=``)."""
    work, ledger = Work(), Ledger(policy)
    if kind == "asgi":
        inner = asgi_app(work)
        app: Any = AskonceASGIMiddleware(JoinASGIMiddleware(inner) if join else inner,
                                         layer="target", ledger=ledger, **options)
        with uvicorn_running(app) as url:
            yield url, work, ledger
    else:
        inner = wsgi_app(work)
        app = AskonceWSGIMiddleware(JoinWSGIMiddleware(inner) if join else inner, layer="target",
                                    ledger=ledger, **options)
        with waitress_running(app) as url:
            yield url, work, ledger


def client(attempts: int = 4, *, own: bool = False) -> httpx.Client:
    """The caller: each try limited to ``TIMEOUT``, by the framework's own read timeout, or
    (``own``) by the policy's ``attempt_timeout`` with httpx's 5 s."""
    policy = ClientPolicy(layer="svc", bucket=None, attempt_timeout=TIMEOUT if own else None,
                          retry=askonce.RetryPolicy(attempts=attempts))
    return httpx.Client(transport=AskonceTransport(httpx.HTTPTransport(), policy=policy),
                        timeout=5.0 if own else TIMEOUT)


def _arrivals(ledger: Ledger) -> int:
    return sum(op.arrivals for op in ledger.report(now=time.time()).operations)


def _left() -> int:
    q = askonce.current()
    assert q is not None
    return q.budget


@pytest.mark.parametrize("kind", ["asgi", "wsgi"])
@pytest.mark.parametrize("method", ["GET", "POST"])
def test_a_timed_out_try_rejoins_the_run_in_flight(kind: str, method: str) -> None:
    with callee(kind, join=True) as (url, work, ledger), client() as http:
        with askonce.question(budget=3, deadline=10.0):
            warm = http.request(method, url + "/warm", content=b"x")  # learns that it joins
        assert warm.status_code == 200
        before = _arrivals(ledger)
        with askonce.question(budget=3, deadline=10.0) as q:
            response = http.request(method, url + "/q", content=b"x")
            left = _left()
        key = q.key
    assert response.status_code == 200 and response.text == "done"
    assert work.runs[key] == 1  # the work was done once
    reply = parse_reply(response.headers[REPLY_HEADER])
    assert not isinstance(reply, Exception) and reply.joins
    assert response.headers["askonce-joined"] in ("wait", "replay")
    seen = _arrivals(ledger) - before
    assert 2 <= seen <= 1 + 3  # each re-attach is an arrival, paid from the budget
    assert left == 3 - (seen - 1)  # what the question has left: one retry per re-attach
    # The ledger sets the work started beside the arrivals: the re-attaches were answered by the
    # run in flight.
    (op,) = [o for o in ledger.report(now=time.time()).operations if o.operation.endswith("/q")]
    assert op.amplification == seen and op.joined == seen - 1 and op.work_per_question == 1.0


@pytest.mark.parametrize("kind", ["asgi", "wsgi"])
def test_toward_a_callee_that_does_not_join_a_timed_out_try_stays_lost(kind: str) -> None:
    with callee(kind, join=False) as (url, work, ledger), client(own=True) as http:
        with askonce.question(budget=3, deadline=10.0):
            http.get(url + "/warm")
        before = _arrivals(ledger)
        with askonce.question(budget=3, deadline=10.0) as q:
            try:
                # The callee may answer at the deadline it was given just before the timeout.
                answer = http.get(url + "/q")
            except askonce.BudgetExhausted as lost:
                assert isinstance(lost.__cause__, httpx.TimeoutException)
            else:
                assert answer.status_code == 503 and "r=deadline" in answer.headers[REPLY_HEADER]
    assert work.runs[q.key] == 1 and _arrivals(ledger) - before == 1  # not retried


@pytest.mark.parametrize("kind", ["asgi", "wsgi"])
def test_toward_a_callee_that_joins_the_policys_attempt_timeout_gives_way_to_waiting(
        kind: str) -> None:
    """The callee answers by the deadline it is given (the question's): the caller waits for it
    instead of timing out into a re-attach, so the question arrives once."""
    with callee(kind, join=True) as (url, work, ledger), client(own=True) as http:
        with askonce.question(budget=3, deadline=10.0):
            http.get(url + "/warm")
        before = _arrivals(ledger)
        with askonce.question(budget=3, deadline=10.0) as q:
            response = http.get(url + "/q")
            left = _left()
    assert response.status_code == 200 and work.runs[q.key] == 1
    assert _arrivals(ledger) - before == 1 and left == 3


def test_a_question_with_no_budget_does_not_rejoin() -> None:
    with callee("asgi", join=True) as (url, work, _), client() as http:
        with askonce.question(budget=3, deadline=10.0):
            http.get(url + "/warm")
        with askonce.question(budget=0, deadline=10.0) as q, pytest.raises(askonce.BudgetExhausted):
            http.get(url + "/q")
    assert work.runs[q.key] == 1


def test_a_callee_that_stops_joining_is_no_longer_rejoined() -> None:
    """The client believes the callee's latest reply: one without ``j`` forgets that it joins."""
    with callee("asgi", join=True) as (url, _, _), client() as http:
        http.get(url + "/warm")
        assert default_target(httpx.Request("GET", url)) in JOINERS
    with callee("asgi", join=False) as (url, _, _), client() as http:
        JOINERS.heard(default_target(httpx.Request("GET", url)), Reply(2, joins=True))
        before = askonce.stats()
        http.get(url + "/warm")
        assert default_target(httpx.Request("GET", url)) not in JOINERS
        assert delta(before).get("client.joiners.forgot") == 1  # counted


def test_a_joining_callee_s_answer_at_the_deadline_says_it_joins() -> None:
    """The middleware cancels the run at the question's deadline and answers for it: the join
    layer inside took the question, so the caller goes on knowing the callee joins."""
    from askonce.core import wire
    from askonce.core.question import Hop

    header = wire.format_question(new_key(), "edge", True, 2, 0.2, (Hop("edge", 1),))
    with callee("asgi", join=True) as (url, work, _), httpx.Client(timeout=5.0) as http:
        response = http.get(url + "/q", headers={wire.QUESTION_HEADER: header})  # runs 0.8 s
    assert response.status_code == 503 and sum(work.runs.values()) == 1
    assert parse_reply(response.headers[REPLY_HEADER]) == Reply(2, True, "deadline", joins=True)


@pytest.mark.parametrize("kind", ["asgi", "wsgi"])
@pytest.mark.parametrize("join", [True, False])
@pytest.mark.parametrize("reason", ["deadline", "cap", "overloaded"])
def test_a_joining_callee_says_so_on_its_own_refusals_before_its_app_runs(
        kind: str, join: bool, reason: str) -> None:
    """A deadline already past, its ledger's cap, its concurrency limit: the middleware refuses
    before its app (and the join layer inside) sees the question. Once the join layer has
    announced itself, such a refusal says ``j`` too, so that a caller, which believes the latest
    reply, goes on knowing that the callee joins; a callee without a join layer never says it."""
    from askonce.core.concurrency import ConcurrencyPolicy
    from askonce.core.wire import QUESTION_HEADER, format_question

    one = ConcurrencyPolicy(initial_limit=1, min_limit=1, max_limit=1)
    # A day's window: no window's end between the key's two arrivals.
    policy = LedgerPolicy(cap=1, window=DAY) if reason == "cap" else LedgerPolicy(window=DAY)
    options = {"concurrency": one} if reason == "overloaded" else {}

    def asked(seconds: float, key: str | None = None) -> dict[str, str]:
        return {QUESTION_HEADER: format_question(key or new_key(), "edge", True, 2, seconds)}

    def refused(http: httpx.Client, url: str) -> httpx.Response:
        """One refusal of ``reason``, the app not run."""
        if reason == "deadline":
            return http.get(url + "/warm", headers=asked(0.0))
        if reason == "cap":
            key = new_key()
            http.get(url + "/warm", headers=asked(5.0, key))  # the key's one arrival
            return http.get(url + "/warm", headers=asked(5.0, key))
        work.released.clear()
        held: list[int] = []
        holding = threading.Thread(
            target=lambda: held.append(http.get(url + "/hold", headers=asked(5.0)).status_code))
        runs = sum(work.runs.values())
        holding.start()  # it holds the one slot until released
        for _ in range(1000):
            if sum(work.runs.values()) > runs or not holding.is_alive():
                break
            time.sleep(0.01)
        try:
            return http.get(url + "/warm", headers=asked(5.0))
        finally:
            work.released.set()
            holding.join(10.0)
            assert not holding.is_alive() and held == [200], held

    with callee(kind, join, policy, **options) as (url, work, _), \
            httpx.Client(timeout=5.0) as http:
        before = refused(http, url)
        http.get(url + "/warm", headers=asked(5.0))  # the join layer (if any) takes it: announced
        after = refused(http, url)
    for response in (before, after):
        assert response.status_code == (429 if reason == "cap" else 503)
        assert parse_reply(response.headers[REPLY_HEADER]).reason == reason
    if reason == "deadline":  # the others' refusals come after a request the join layer took
        assert not parse_reply(before.headers[REPLY_HEADER]).joins
    reply = parse_reply(after.headers[REPLY_HEADER])
    assert reply.joins is join and reply.dnr
    JOINERS.heard("svc:1", Reply(2, joins=True))
    JOINERS.heard("svc:1", reply)
    assert ("svc:1" in JOINERS) is join


@pytest.mark.parametrize("kind", ["asgi", "wsgi"])
def test_a_reattach_with_no_run_to_join_is_refused_never_run(kind: str) -> None:
    """The run it is for may have failed, gone to another replica or been forgotten: running the
    re-attach anew could do the work twice and spend the budget twice."""
    from askonce.core.wire import QUESTION_HEADER, format_question, is_rejoin

    header = format_question(new_key(), "edge", True, 1, 5.0, (), None, rejoin=True)
    assert is_rejoin(header) and not is_rejoin(header[: -len(", j")])
    with callee(kind, join=True) as (url, work, ledger):
        refused = httpx.post(url + "/q", content=b"x", headers={QUESTION_HEADER: header})
        plain = httpx.post(url + "/warm", content=b"x", timeout=5.0,
                           headers={QUESTION_HEADER: header[: -len(", j")]})
    assert refused.status_code == 503 and sum(work.runs.values()) == 1  # only the plain one ran
    assert parse_reply(refused.headers[REPLY_HEADER]) == Reply(0, True, "exhausted", joins=True)
    assert plain.status_code == 200
    assert _arrivals(ledger) == 2  # both arrived, and were counted


def test_a_wsgi_body_of_undeclared_length_is_compared_to_its_end() -> None:
    """A chunked body on a terminated input is read to its end and compared: the same key with
    another body is refused (422), never replayed the first one's answer."""
    import io

    from askonce.core.wire import format_question

    seen: list[bytes] = []

    def echo(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        data = environ["wsgi.input"].read()
        seen.append(data)
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"charged " + data]

    app = AskonceWSGIMiddleware(JoinWSGIMiddleware(echo), layer="t")
    header = format_question(new_key(), "svc", False, 2, 10.0)
    statuses: list[str] = []
    for body in (b"amount=1", b"amount=999"):
        environ = {"REQUEST_METHOD": "POST", "PATH_INFO": "/q", "QUERY_STRING": "",
                   "SERVER_NAME": "x", "SERVER_PORT": "80", "wsgi.url_scheme": "http",
                   "wsgi.input": io.BytesIO(body), "wsgi.input_terminated": True,
                   "HTTP_ASKONCE_QUESTION": header}
        b"".join(app(environ, lambda status, headers, exc_info=None: statuses.append(status)))
    assert seen == [b"amount=1"] and statuses[0].startswith("200")
    assert statuses[1].startswith("422")  # another body under the key: refused, not replayed


def test_joining_callees_are_remembered_safely_from_many_threads() -> None:
    import threading

    from askonce.client import Joiners

    joiners, errors = Joiners(limit=8), []

    def hammer(n: int) -> None:
        try:
            for i in range(2000):
                joiners.heard(f"t{n}-{i}", Reply(1, joins=i % 3 != 0))
        except Exception as exc:  # a dict changed under another thread's eviction
            errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(joiners) <= 8
