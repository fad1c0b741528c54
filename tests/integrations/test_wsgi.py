"""The WSGI middleware under a real waitress serving Flask (and a bare WSGI app), driven by httpx."""

from __future__ import annotations

import collections
import concurrent.futures
import time
from collections.abc import Iterable, Iterator
from typing import Any

import flask
import httpx
import pytest
import werkzeug.test

import askonce
from askonce import Limits, Reply
from askonce.core import wire
from askonce.core.backoff import NO_WAIT
from askonce.core.ledger import Kind, Ledger, LedgerPolicy
from askonce.core.question import Hop
from askonce.core.wire import QUESTION_HEADER, REPLY_HEADER
from askonce.errors import attach_reply
from askonce.integrations.wsgi import LEDGER_LOCK, AskonceWSGIMiddleware
from e2e_services import waitress_running

DAY = 86_400.0  # one ledger window for the whole run: no window boundary in the middle of a test


def seen() -> dict[str, Any]:
    q = askonce.current()
    assert q is not None
    return {"key": q.key, "origin": q.origin, "edge": q.edge, "budget": q.budget,
            "remaining": q.remaining(askonce._stats.monotonic()), "path": [str(h) for h in q.path]}


def make_flask(calls: collections.Counter[str]) -> flask.Flask:
    app = flask.Flask("askonce-test")

    @app.get("/items/<int:item_id>")
    def item(item_id: int) -> dict[str, Any]:
        calls["items"] += 1
        time.sleep(0.01)  # long enough for concurrent requests to overlap
        return seen()

    @app.get("/spend")
    def spend() -> dict[str, Any]:
        failures = iter([ConnectionError("once")])

        @askonce.retry(on=ConnectionError, layer="svc-db", backoff=NO_WAIT, bucket=None)
        def db() -> None:
            for exc in failures:
                raise exc

        db()
        return seen()

    @app.get("/exhaust")
    def exhaust() -> None:
        @askonce.retry(on=ConnectionError, layer="svc-db", backoff=NO_WAIT, bucket=None)
        def db() -> None:
            raise ConnectionError("down")

        db()

    @app.get("/pushback")
    def pushback() -> None:
        raise askonce.DoNotRetry("callee overloaded", reply=Reply(0, True, "overloaded", 0.2), layer="svc",
                                 key=None, attempts=1)

    @app.get("/handled")
    def handled() -> None:
        raise askonce.BudgetExhausted("spent", reply=Reply(0, True, "exhausted"), layer="svc", key=None, attempts=2)

    @app.errorhandler(askonce.BudgetExhausted)
    def own_answer(exc: askonce.BudgetExhausted) -> tuple[str, int]:
        if flask.request.path != "/handled":
            raise exc
        return "the app answers this one itself", 502

    @app.get("/boom")
    def boom() -> None:
        raise RuntimeError("a plain bug")

    @app.get("/stream")
    def stream() -> flask.Response:
        def chunks() -> Iterator[str]:
            for _ in range(3):
                yield seen()["key"] + "\n"  # runs while waitress iterates the body, after the view returned

        return flask.Response(chunks(), mimetype="text/plain")

    return app


def bare(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
    """A WSGI app with no framework: exceptions escape it."""
    if environ["PATH_INFO"] == "/bare/exhaust":
        raise askonce.BudgetExhausted("spent", reply=Reply(0, True, "exhausted"), layer="bare", key=None, attempts=3)
    if environ["PATH_INFO"] == "/bare/foreign":
        exc = ConnectionResetError("a client library's error, the reply attached")
        attach_reply(exc, Reply(1, True, "breaker-open", 4.0))
        raise exc
    start_response("200 OK", [("content-type", "application/json")])
    return [flask.json.dumps(seen()).encode()]


class Stack:
    def __init__(self, url: str, calls: collections.Counter[str], ledger: Ledger) -> None:
        self.url = url
        self.client = httpx.Client(base_url=url, timeout=5.0)
        self.calls = calls
        self.ledger = ledger

    def report(self, operation: str) -> Any:
        with LEDGER_LOCK:
            return self.ledger.report(time.time()).find(operation)


# waitress closed from the test's thread under its loop's select() fails that select with EBADF;
# e2e_services closes it from the loop's own thread.
running = waitress_running


@pytest.fixture(scope="module")
def svc() -> Iterator[Stack]:
    calls: collections.Counter[str] = collections.Counter()
    ledger = Ledger(LedgerPolicy(window=DAY, cap=4))
    app = make_flask(calls)
    app.wsgi_app = AskonceWSGIMiddleware(  # type: ignore[method-assign]
        app.wsgi_app, layer="svc", limits=Limits(max_budget=3, max_deadline=10.0), ledger=ledger,
        principal=lambda environ: environ.get("HTTP_X_TENANT", ""))
    bare_app = AskonceWSGIMiddleware(bare, layer="bare", ledger=ledger)
    edge_app = AskonceWSGIMiddleware(bare, layer="edge", originator=True)

    def root(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        path = environ["PATH_INFO"]
        inner = bare_app if path.startswith("/bare") else edge_app if path.startswith("/edge") else app
        return inner(environ, start_response)

    with running(root) as url:
        stack = Stack(url, calls, ledger)
        with stack.client:
            yield stack


def question(budget: int = 2, deadline_ms: int | None = 5000, key: str | None = None) -> dict[str, str]:
    value = wire.format_question(key or askonce.propagation.new_key(), "edge", True, budget,
                                 None if deadline_ms is None else deadline_ms / 1000, (Hop("api", 2),))
    return {QUESTION_HEADER: value}


def key_of(headers: dict[str, str]) -> str:
    q = askonce.propagation.extract(headers)
    assert q is not None
    return q.key


def reply(response: httpx.Response) -> Reply:
    parsed = wire.parse_reply(response.headers[REPLY_HEADER])
    assert isinstance(parsed, Reply), parsed
    return parsed


# --- the question in, the reply out -----------------------------------------------------------------


def test_the_view_sees_the_question_that_was_sent(svc: Stack) -> None:
    headers = question(budget=2)
    r = svc.client.get("/items/1", headers=headers)
    got = r.json()
    assert got["key"] == key_of(headers)
    assert (got["origin"], got["edge"], got["budget"], got["path"]) == ("edge", True, 2, ["api:2"])
    assert 0 < got["remaining"] <= 5.0
    assert reply(r) == Reply(2)


def test_budget_and_deadline_are_clamped(svc: Stack) -> None:
    got = svc.client.get("/items/1", headers=question(budget=500, deadline_ms=3_600_000)).json()
    assert got["budget"] == 3
    assert 0 < got["remaining"] <= 10.0


def test_a_malformed_header_is_counted_treated_as_absent_and_recorded(svc: Stack) -> None:
    before = askonce.stats().get("malformed.question.version", 0)
    op = svc.report("GET /items/<int:item_id>")
    malformed_before = 0 if op is None else op.kinds[Kind.MALFORMED]
    got = svc.client.get("/items/2", headers={QUESTION_HEADER: "v=9"}).json()
    assert (got["origin"], got["edge"]) == ("svc", False)
    assert askonce.stats()["malformed.question.version"] == before + 1
    assert svc.report("GET /items/<int:item_id>").kinds[Kind.MALFORMED] == malformed_before + 1


def test_absent_question_mints_local_here_and_edge_at_an_originator(svc: Stack) -> None:
    local = svc.client.get("/items/1").json()
    assert (local["origin"], local["edge"], local["path"]) == ("svc", False, [])
    edge = svc.client.get("/edge/anything").json()
    assert (edge["origin"], edge["edge"]) == ("edge", True)


def test_the_reply_carries_what_is_left_after_a_retry_inside_the_view(svc: Stack) -> None:
    r = svc.client.get("/spend", headers=question(budget=3))
    assert r.json()["budget"] == 2
    assert reply(r) == Reply(2)


def test_the_question_stays_bound_while_the_body_is_iterated(svc: Stack) -> None:
    headers = question()
    r = svc.client.get("/stream", headers=headers)
    assert r.text.split() == [key_of(headers)] * 3


# --- failures -----------------------------------------------------------------------------------------


def test_budget_exhausted_in_a_flask_view_becomes_503_do_not_retry(svc: Stack) -> None:
    r = svc.client.get("/exhaust", headers=question(budget=0))
    assert r.status_code == 503  # not Flask's own 500: the middleware heard got_request_exception
    assert reply(r) == Reply(0, True, "exhausted")
    assert r.text == "askonce: exhausted\n"


def test_pushback_becomes_retry_after(svc: Stack) -> None:
    r = svc.client.get("/pushback", headers=question())
    assert (r.status_code, r.headers["retry-after"]) == (503, "1")
    assert reply(r) == Reply(0, True, "overloaded", 0.2)


def test_an_answer_the_app_gives_itself_is_kept_and_carries_the_do_not_retry(svc: Stack) -> None:
    r = svc.client.get("/handled", headers=question())
    assert (r.status_code, r.text) == (502, "the app answers this one itself")
    assert reply(r).budget == 2 and not reply(r).dnr  # the handler answered: nothing was noted


def test_a_plain_exception_gets_flasks_500_with_the_reply(svc: Stack) -> None:
    r = svc.client.get("/boom", headers=question(budget=2))
    assert r.status_code == 500
    assert reply(r) == Reply(2)


@pytest.mark.parametrize(("path", "expected", "retry_after"), [
    ("/bare/exhaust", Reply(0, True, "exhausted"), None),
    ("/bare/foreign", Reply(1, True, "breaker-open", 4.0), "4"),
])
def test_a_give_up_escaping_a_bare_wsgi_app_becomes_503(svc: Stack, path: str, expected: Reply,
                                                        retry_after: str | None) -> None:
    r = svc.client.get(path, headers=question(budget=2))
    assert r.status_code == 503
    assert reply(r) == expected
    assert r.headers.get("retry-after") == retry_after


def test_an_arrival_past_its_deadline_is_refused_before_the_view_runs(svc: Stack) -> None:
    before = svc.calls["items"]
    r = svc.client.get("/items/4", headers=question(budget=1, deadline_ms=0))
    assert r.status_code == 503
    assert reply(r) == Reply(1, True, "deadline")
    assert svc.calls["items"] == before


# --- the ledger -----------------------------------------------------------------------------------------


def test_the_cap_holds_exactly_under_concurrent_arrivals_and_is_scoped_per_principal(svc: Stack) -> None:
    headers = {**question(), "x-tenant": "a"}
    before = svc.calls["items"]

    def get(_: int) -> httpx.Response:
        return httpx.get(svc.url + "/items/7", headers=headers, timeout=5.0)

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        responses = list(pool.map(get, range(12)))
    codes = collections.Counter(r.status_code for r in responses)
    assert codes == {200: 4, 429: 8}
    assert svc.calls["items"] == before + 4
    refused = next(r for r in responses if r.status_code == 429)
    assert reply(refused) == Reply(2, True, "cap")
    assert svc.client.get("/items/7", headers={**headers, "x-tenant": "b"}).status_code == 200


def test_the_operation_is_the_flask_rule_not_the_raw_path(svc: Stack) -> None:
    op = svc.report("GET /items/<int:item_id>")
    before = 0 if op is None else op.arrivals
    svc.client.get("/items/42", headers=question())
    svc.client.get("/items/43", headers=question())
    assert svc.report("GET /items/<int:item_id>").arrivals == before + 2
    assert svc.report("GET /items/42") is None
    svc.client.get("/bare/orders/1234")  # no route table: ids are replaced in the path
    assert svc.report("GET /bare/orders/{id}") is not None
    assert svc.client.get("/nowhere").status_code == 404
    assert svc.report("GET ~unmatched") is not None


@pytest.mark.parametrize("options", [{"layer": "a b"}, {"budget": -1}, {"deadline": -1.0}, {"ledger": 3},
                                     {"principal": "x"}, {"shed_deadline": "no"}])
def test_bad_options_are_refused_with_value_error(options: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        AskonceWSGIMiddleware(bare, **{"layer": "svc", **options})


def test_with_propagate_exceptions_the_give_up_escapes_flask_and_still_becomes_503() -> None:
    app = make_flask(collections.Counter())
    app.config["PROPAGATE_EXCEPTIONS"] = True
    client = werkzeug.test.Client(AskonceWSGIMiddleware(app.wsgi_app, layer="svc"))
    r = client.get("/exhaust", headers=question(budget=0))
    assert r.status_code == 503
    assert r.headers[REPLY_HEADER] == "v=1, b=0, dnr, r=exhausted"
    with pytest.raises(RuntimeError):
        client.get("/boom", headers=question())  # anything else propagates as configured


# --- signed edge keys -----------------------------------------------------------------------------------

SECRET = b"0123456789abcdef0123"


def test_edge_keys_are_checked_against_the_secret_with_a_thread_safe_ledger() -> None:
    from askonce.ledger.store import MemoryLedger

    ledger = MemoryLedger(LedgerPolicy(window=DAY))
    app = AskonceWSGIMiddleware(bare, layer="target", ledger=ledger, edge_secret=SECRET)
    before = askonce.stats().get("ledger.edge.unsigned", 0)
    with running(app) as url, httpx.Client(base_url=url, timeout=5.0) as client:
        for sig_with in (SECRET, b"someone else's secret key", None):
            key = askonce.propagation.new_key()
            sig = None if sig_with is None else askonce.core.signing.mac(key, sig_with)
            value = wire.format_question(key, "edge", True, 2, 5.0, (Hop("api", 1),), sig)
            assert client.get("/x", headers={QUESTION_HEADER: value}).status_code == 200
    op = ledger.report(time.time()).find("GET /x")
    assert (op.arrivals, op.attributable, op.reminted_by) == (3, 1, {"~unsigned": 2})
    assert askonce.stats()["ledger.edge.unsigned"] == before + 2


def test_an_originator_signs_the_keys_it_mints() -> None:
    def signed(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        q = askonce.current()
        assert q is not None
        start_response("200 OK", [("content-type", "application/json")])
        return [flask.json.dumps({"key": q.key, "edge": q.edge, "sig": (q.sig or b"").hex()}).encode()]

    app = AskonceWSGIMiddleware(signed, layer="edge", originator=True, edge_secret=[SECRET])
    with running(app) as url:
        got = httpx.get(url + "/x", timeout=5.0).json()
    assert got["edge"] and askonce.core.signing.verify_key(got["key"], bytes.fromhex(got["sig"]), SECRET)


def test_a_request_leaves_no_cycle_for_the_garbage_collector() -> None:
    import gc

    app = AskonceWSGIMiddleware(bare, layer="svc", ledger=Ledger(LedgerPolicy(window=DAY)))

    def request(headers: dict[str, str]) -> None:
        environ = werkzeug.test.EnvironBuilder(path="/x", headers=headers).get_environ()
        body = app(environ, lambda status, headers, exc_info=None: lambda data: None)
        list(body)
        body.close()  # type: ignore[attr-defined]

    request(question())
    gc.collect()
    gc.disable()
    try:
        for headers in (question(), {}, {QUESTION_HEADER: "v=1, k=nope"}):
            request(headers)
        assert gc.collect() == 0  # freed as the request ended, not left for a collection
    finally:
        gc.enable()
