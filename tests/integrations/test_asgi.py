"""The ASGI middleware under a real uvicorn serving FastAPI, driven by a real httpx client over loopback."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import BackgroundTasks, FastAPI, Request

import askonce
from askonce import Limits, Reply
from askonce.core import wire
from askonce.core.backoff import NO_WAIT
from askonce.core.ledger import Kind, Ledger, LedgerPolicy
from askonce.core.naming import path_template
from askonce.core.question import Hop
from askonce.core.wire import QUESTION_HEADER, REPLY_HEADER
from askonce.errors import attach_reply
from askonce.integrations.asgi import (
    LEDGER_LOCK,
    SWEEP_EVERY,
    AskonceASGIMiddleware,
    note_failure,
    route_operations,
)

DAY = 86_400.0  # one ledger window for the whole run: no window boundary in the middle of a test


class Probe:
    """What the handlers saw, shared between uvicorn's thread and the test."""

    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        self.seen: dict[str, Any] = {}
        self._events: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def event(self, name: str) -> threading.Event:
        with self._lock:
            return self._events.setdefault(name, threading.Event())


def seen() -> dict[str, Any]:
    q = askonce.current()
    assert q is not None
    return {"key": q.key, "origin": q.origin, "edge": q.edge, "budget": q.budget,
            "remaining": q.remaining(askonce._stats.monotonic()), "path": [str(h) for h in q.path]}


def make_app(probe: Probe) -> FastAPI:
    app = FastAPI()

    @app.get("/items/{item_id}")
    async def item(item_id: int) -> dict[str, Any]:
        probe.calls["items"] += 1
        return seen()

    @app.get("/spend")
    async def spend() -> dict[str, Any]:
        failures = iter([ConnectionError("once")])

        @askonce.retry(on=ConnectionError, layer="api-db", backoff=NO_WAIT, bucket=None)
        async def db() -> None:
            for exc in failures:
                raise exc

        await db()
        return seen()

    @app.get("/exhaust")
    async def exhaust() -> None:
        probe.calls["exhaust"] += 1

        @askonce.retry(on=ConnectionError, layer="api-db", backoff=NO_WAIT, bucket=None)
        async def db() -> None:
            raise ConnectionError("down")

        await db()

    @app.get("/pushback")
    async def pushback() -> None:
        raise askonce.DoNotRetry("callee overloaded", reply=Reply(0, True, "overloaded", 2.5), layer="api",
                                 key=None, attempts=1)

    @app.get("/foreign")
    async def foreign() -> None:
        exc = RuntimeError("a client library's own error, with the reply attached by askonce")
        attach_reply(exc, Reply(1, True, "overloaded"))
        raise exc

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("a plain bug")

    @app.get("/slow")
    async def slow(id: str) -> str:
        probe.event(f"{id}.started").set()
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            probe.event(f"{id}.cancelled").set()
            raise
        probe.event(f"{id}.done").set()
        return "done"

    @app.get("/background")
    async def background(tasks: BackgroundTasks) -> dict[str, Any]:
        async def later() -> None:
            probe.seen["background"] = seen()["key"]
            probe.event("background").set()

        child = await asyncio.create_task(asyncio.sleep(0, result=seen()["key"]))
        tasks.add_task(later)
        return {"handler": seen()["key"], "task": child}

    @app.post("/upload")
    async def upload(request: Request, wait: float = 0.0) -> str:
        await asyncio.sleep(wait)  # past WATCH_AFTER the body comes through the disconnect watcher
        return hashlib.sha256(await request.body()).hexdigest()

    @app.post("/ignore-body")
    async def ignore_body() -> str:
        await asyncio.sleep(0.05)  # long enough for a read-ahead to have asked for the body
        return "no thanks"

    return app


@contextlib.contextmanager
def running(app: Any) -> Iterator[str]:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="off", log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    limit = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < limit, "uvicorn did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


class Stack:
    def __init__(self, url: str, probe: Probe, ledger: Ledger) -> None:
        self.client = httpx.Client(base_url=url, timeout=5.0)
        self.url = url
        self.probe = probe
        self.ledger = ledger

    def report(self, operation: str) -> Any:
        with LEDGER_LOCK:
            return self.ledger.report(time.time()).find(operation)


@pytest.fixture(scope="module")
def api() -> Iterator[Stack]:
    """FastAPI with the middleware added the usual way (inside Starlette, so scope["app"] is set)."""
    probe = Probe()
    ledger = Ledger(LedgerPolicy(window=DAY, cap=2))
    app = make_app(probe)
    app.add_middleware(AskonceASGIMiddleware, layer="api", limits=Limits(max_budget=3, max_deadline=10.0),
                       ledger=ledger, principal=lambda scope: dict(scope["headers"]).get(b"x-tenant", b"").decode())
    with running(app) as url:
        stack = Stack(url, probe, ledger)
        with stack.client:
            yield stack


@pytest.fixture(scope="module")
def edge() -> Iterator[Stack]:
    """The same app wrapped from outside, as an originator: no scope["app"] before routing."""
    probe = Probe()
    ledger = Ledger(LedgerPolicy(window=DAY))
    app = AskonceASGIMiddleware(make_app(probe), layer="edge", originator=True, ledger=ledger)
    with running(app) as url:
        stack = Stack(url, probe, ledger)
        with stack.client:
            yield stack


def question(budget: int = 2, deadline_ms: int | None = 5000, key: str | None = None) -> dict[str, str]:
    value = wire.format_question(key or askonce.propagation.new_key(), "edge", True, budget,
                                 None if deadline_ms is None else deadline_ms / 1000, (Hop("edge", 1),))
    return {QUESTION_HEADER: value}


def reply(response: httpx.Response) -> Reply:
    parsed = wire.parse_reply(response.headers[REPLY_HEADER])
    assert isinstance(parsed, Reply), parsed
    return parsed


# --- the question in, the reply out -----------------------------------------------------------------


def test_the_handler_sees_the_question_that_was_sent(api: Stack) -> None:
    headers = question(budget=2)
    r = api.client.get("/items/1", headers=headers)
    assert r.status_code == 200
    got = r.json()
    assert askonce.propagation.extract(headers) is not None
    assert got["key"] == wire.parse_question(headers[QUESTION_HEADER], 0.0).key  # type: ignore[union-attr]
    assert (got["origin"], got["edge"], got["budget"], got["path"]) == ("edge", True, 2, ["edge:1"])
    assert 0 < got["remaining"] <= 5.0
    assert reply(r) == Reply(2)


def test_budget_and_deadline_are_clamped_to_the_layers_limits(api: Stack) -> None:
    got = api.client.get("/items/1", headers=question(budget=50, deadline_ms=3_600_000)).json()
    assert got["budget"] == 3
    assert 0 < got["remaining"] <= 10.0


def test_a_malformed_header_is_counted_treated_as_absent_and_recorded(api: Stack) -> None:
    before = askonce.stats().get("malformed.question.key", 0)
    op_before = api.report("GET /items/{item_id}")
    r = api.client.get("/items/3", headers={QUESTION_HEADER: 'v=1, k="short", o=edge, b=2'})
    assert r.status_code == 200
    got = r.json()
    assert (got["origin"], got["edge"]) == ("api", False)  # a local key minted here, not the bad one
    assert askonce.stats()["malformed.question.key"] == before + 1
    malformed_before = 0 if op_before is None else op_before.kinds[Kind.MALFORMED]
    assert api.report("GET /items/{item_id}").kinds[Kind.MALFORMED] == malformed_before + 1


def test_absent_question_mints_a_local_key_here_and_an_edge_key_at_an_originator(api: Stack, edge: Stack) -> None:
    local = api.client.get("/items/1").json()
    assert (local["origin"], local["edge"], local["budget"], local["path"]) == ("api", False, 2, [])
    minted = edge.client.get("/items/1").json()
    assert (minted["origin"], minted["edge"]) == ("edge", True)
    assert len(minted["key"]) == 36 and minted["key"] != local["key"]
    assert 29 < minted["remaining"] <= 30.0  # the layer's default deadline for questions it mints


def test_the_reply_carries_what_is_left_after_a_retry_inside_the_handler(api: Stack) -> None:
    r = api.client.get("/spend", headers=question(budget=3))
    assert r.status_code == 200
    assert r.json()["budget"] == 2
    assert reply(r) == Reply(2)


def test_contextvars_reach_tasks_and_background_work(api: Stack) -> None:
    headers = question()
    key = askonce.propagation.extract(headers).key  # type: ignore[union-attr]
    got = api.client.get("/background", headers=headers).json()
    assert got == {"handler": key, "task": key}
    assert api.probe.event("background").wait(5)
    assert api.probe.seen["background"] == key


# --- failures -----------------------------------------------------------------------------------------


def test_budget_exhausted_downstream_answers_503_do_not_retry(api: Stack) -> None:
    r = api.client.get("/exhaust", headers=question(budget=0))
    assert r.status_code == 503
    assert reply(r) == Reply(0, True, "exhausted")
    assert "retry-after" not in r.headers


def test_pushback_becomes_retry_after(api: Stack) -> None:
    r = api.client.get("/pushback", headers=question(budget=2))
    assert r.status_code == 503
    assert r.headers["retry-after"] == "3"
    assert reply(r) == Reply(0, True, "overloaded", 2.5)


def test_any_exception_carrying_a_reply_is_answered_503(api: Stack) -> None:
    r = api.client.get("/foreign", headers=question(budget=2))
    assert r.status_code == 503
    assert reply(r) == Reply(1, True, "overloaded")


def test_a_plain_exception_is_left_to_the_framework(api: Stack) -> None:
    # uvicorn closes the connection after an app exception: a connection of its own, not the shared one
    r = httpx.get(api.url + "/boom", headers=question(), timeout=5.0)
    assert r.status_code == 500


# --- deadline shedding and cancellation -----------------------------------------------------------


def test_an_arrival_past_its_deadline_is_refused_before_the_handler_runs(api: Stack) -> None:
    before = api.probe.calls["items"]
    r = api.client.get("/items/5", headers=question(budget=2, deadline_ms=0))
    assert r.status_code == 503
    assert reply(r) == Reply(2, True, "deadline")
    assert api.probe.calls["items"] == before


def test_a_handler_still_running_at_the_deadline_is_cancelled(api: Stack) -> None:
    r = api.client.get("/slow", params={"id": "deadline"}, headers=question(deadline_ms=300))
    assert r.status_code == 503
    assert reply(r) == Reply(2, True, "deadline")
    assert api.probe.event("deadline.cancelled").wait(5)
    assert not api.probe.event("deadline.done").is_set()


def test_a_client_that_disconnects_cancels_its_handler(api: Stack) -> None:
    before = askonce.stats().get("server.cancelled.disconnect", 0)
    port = int(api.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"GET /slow?id=gone HTTP/1.1\r\nHost: x\r\n\r\n")
        assert api.probe.event("gone.started").wait(5)
    assert api.probe.event("gone.cancelled").wait(5)
    assert not api.probe.event("gone.done").is_set()
    assert askonce.stats()["server.cancelled.disconnect"] == before + 1


@pytest.mark.parametrize("wait", [0.0, 0.2])
def test_request_bodies_still_reach_the_app(api: Stack, wait: float) -> None:
    body = bytes(range(256)) * 1200  # several receive() messages
    r = api.client.post("/upload", params={"wait": wait}, content=body, headers=question())
    assert r.json() == hashlib.sha256(body).hexdigest()
    assert reply(r) == Reply(2)


def test_expect_100_continue_is_left_to_the_app(api: Stack) -> None:
    port = int(api.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"POST /ignore-body HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n")
        head = sock.recv(65536)
    assert head.startswith(b"HTTP/1.1 200"), head  # no "100 Continue": the app never asked for the body


# --- the ledger -----------------------------------------------------------------------------------------


def test_over_the_cap_is_answered_429_without_running_the_handler(api: Stack) -> None:
    headers = question(budget=2)
    before = api.probe.calls["items"]
    codes = [api.client.get("/items/9", headers={**headers, "x-tenant": "a"}).status_code for _ in range(3)]
    assert codes == [200, 200, 429]
    assert api.probe.calls["items"] == before + 2
    r = api.client.get("/items/9", headers={**headers, "x-tenant": "a"})
    assert reply(r) == Reply(2, True, "cap")
    # the same key under another principal is another question
    assert api.client.get("/items/9", headers={**headers, "x-tenant": "b"}).status_code == 200


def test_the_operation_is_the_route_template_not_the_raw_path(api: Stack, edge: Stack) -> None:
    for stack in (api, edge):
        before = stack.report("GET /items/{item_id}")
        n = 0 if before is None else before.arrivals
        for item in (42, 43):
            stack.client.get(f"/items/{item}", headers=question())
        assert stack.report("GET /items/{item_id}").arrivals == n + 2
        assert stack.report("GET /items/42") is None
    assert api.client.get("/nowhere/42").status_code == 404
    assert api.report("GET ~unmatched") is not None


def test_an_edge_key_that_arrives_is_attributable(edge: Stack) -> None:
    before = edge.report("GET /items/{item_id}")
    attributable = 0 if before is None else before.attributable
    edge.client.get("/items/1", headers=question())
    assert edge.report("GET /items/{item_id}").attributable == attributable + 1


def test_the_fallback_operation_name_replaces_ids() -> None:
    assert path_template("GET", "/users/42/orders/0b0e5f2c-4c9f-4a57-9b52-6b0e1f7f3b11") == \
        "GET /users/{id}/orders/{id}"
    assert path_template("DELETE", "/keys/01HZY3M4ZK2V7ZQ9P0A1B2C3D4/") == "DELETE /keys/{id}/"
    assert path_template("GET", "/internationalization-settings") == "GET /internationalization-settings"
    assert len(path_template("GET", "/" + "a" * 10_000)) <= 160


async def test_route_operations_lists_every_name_the_route_table_gives() -> None:
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Mount, Route, WebSocketRoute

    async def ok(request: Any) -> PlainTextResponse:
        return PlainTextResponse("ok")

    async def ws(websocket: Any) -> None:
        await websocket.close()

    app = Starlette(routes=[
        Route("/items/{item_id:int}", ok), Route("/orders", ok, methods=["POST"]),
        WebSocketRoute("/ws", ws),
        Mount("/api", routes=[Route("/users/{name}", ok, methods=["GET", "DELETE"])]),
        Mount("/static", app=PlainTextResponse("file")),
    ])
    ledger = Ledger(LedgerPolicy(window=DAY))
    transport = httpx.ASGITransport(app=AskonceASGIMiddleware(app, layer="api", ledger=ledger))
    sent = [("GET", "/items/7"), ("HEAD", "/items/7"), ("POST", "/orders"),
            ("DELETE", "/api/users/ann"), ("GET", "/api/nowhere"), ("PUT", "/static/a/b.css"),
            ("GET", "/nowhere"), ("PATCH", "/nowhere")]
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        for method, path in sent:
            await client.request(method, path)
        await client.request("POST", "/items/7")  # a method the route does not take: not listed
    names = route_operations(app)
    recorded = [o.operation for o in ledger.report(time.time()).operations]
    assert set(recorded) - set(names) == {"POST /items/{item_id:int}"}
    assert len(recorded) == len(sent) + 1
    assert "GET /ws" not in names and "GET /static/{path:path}" in names
    assert route_operations(lambda scope, receive, send: None) == []


# --- in-process: scopes other than http, and options ----------------------------------------------------


async def test_non_http_scopes_pass_through_untouched() -> None:
    calls: list[tuple[Any, Any, Any]] = []

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        calls.append((scope, receive, send))

    mw = AskonceASGIMiddleware(inner, layer="api", ledger=Ledger())

    async def receive() -> dict[str, Any]:
        return {"type": "lifespan.startup"}

    async def send(message: Any) -> None:
        raise AssertionError("the middleware must not send anything itself")

    for scope in ({"type": "lifespan", "asgi": {"version": "3.0"}},
                  {"type": "websocket", "path": "/ws", "headers": list(question().items())}):
        await mw(scope, receive, send)
        assert calls[-1][0] is scope and calls[-1][1] is receive and calls[-1][2] is send
        assert scope.keys() <= {"type", "asgi", "path", "headers"}


class Exchange:
    """A server's side of one in-process request: a receive that waits like uvicorn's, a recording send."""

    def __init__(self, headers: dict[str, str] | None = None) -> None:
        self.scope = {"type": "http", "method": "GET", "path": "/", "headers": [
            (k.encode(), v.encode()) for k, v in (headers or {}).items()]}
        self.sent: list[dict[str, Any]] = []
        self.body_sent = False

    async def receive(self) -> dict[str, Any]:
        if not self.body_sent:
            self.body_sent = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.sleep(3600)  # until the response is complete or the client goes away
        raise AssertionError("unreachable")

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)


async def sleepy(scope: Any, receive: Any, send: Any) -> None:
    await asyncio.sleep(0.2)
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


async def test_a_minted_deadline_does_not_cancel_the_handler() -> None:
    # Only a deadline the caller sent says when the caller stops listening; a minted one bounds retries.
    mw = AskonceASGIMiddleware(sleepy, layer="api", deadline=0.01)
    ex = Exchange()
    await mw(ex.scope, ex.receive, ex.send)
    assert ex.sent[0]["status"] == 200


async def test_a_cancellation_from_the_server_is_never_swallowed() -> None:
    mw = AskonceASGIMiddleware(sleepy, layer="api")
    ex = Exchange(question(deadline_ms=1000))
    task = asyncio.create_task(mw(ex.scope, ex.receive, ex.send))
    await asyncio.sleep(0.05)
    task.cancel()  # e.g. the server shutting down, before the deadline
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ex.sent == []


async def test_a_cancellation_from_the_server_after_the_deadline_is_not_swallowed_either() -> None:
    async def stubborn(scope: Any, receive: Any, send: Any) -> None:
        try:
            await asyncio.sleep(1)
        except asyncio.CancelledError:
            await asyncio.sleep(1)  # cleanup during which the server cancels as well
            raise

    mw = AskonceASGIMiddleware(stubborn, layer="api")
    ex = Exchange(question(deadline_ms=50))
    task = asyncio.create_task(mw(ex.scope, ex.receive, ex.send))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.parametrize("options", [
    {"layer": ""}, {"layer": "no spaces"}, {"layer": "x" * 40}, {"budget": -1}, {"budget": 1001},
    {"budget": True}, {"deadline": 0}, {"deadline": 100_000}, {"limits": {"max_budget": 3}},
    {"ledger": object()}, {"principal": "tenant"}, {"operation": 3}, {"originator": "yes"},
    {"shed_deadline": 1}, {"cancel_on_disconnect": None},
])
def test_bad_options_are_refused_with_value_error(options: dict[str, Any]) -> None:
    async def inner(scope: Any, receive: Any, send: Any) -> None: ...

    with pytest.raises(ValueError):
        AskonceASGIMiddleware(inner, **{"layer": "api", **options})


async def test_an_app_that_swallows_the_deadline_cancellation_is_still_answered_503() -> None:
    async def swallower(scope: Any, receive: Any, send: Any) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(1)

    mw = AskonceASGIMiddleware(swallower, layer="api")
    ex = Exchange(question(deadline_ms=50))
    await mw(ex.scope, ex.receive, ex.send)
    assert ex.sent[0]["status"] == 503
    assert (REPLY_HEADER.encode(), b"v=1, b=2, dnr, r=deadline") in ex.sent[0]["headers"]
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_a_noted_give_up_replaces_the_frameworks_own_500() -> None:
    # What Django's ASGI handler does: catch, answer 500 itself; its signal hook calls note_failure.
    async def converts(scope: Any, receive: Any, send: Any) -> None:
        try:
            raise askonce.CircuitOpen("open", reply=Reply(0, True, "breaker-open", 1.5), layer="db", key=None,
                                      attempts=1)
        except askonce.GaveUp as exc:
            note_failure(exc)
        await send({"type": "http.response.start", "status": 500, "headers": [(b"content-length", b"5")]})
        await send({"type": "http.response.body", "body": b"oops!"})

    mw = AskonceASGIMiddleware(converts, layer="api")
    ex = Exchange(question(budget=2))
    await mw(ex.scope, ex.receive, ex.send)
    assert [m["type"] for m in ex.sent] == ["http.response.start", "http.response.body"]
    assert ex.sent[0]["status"] == 503
    headers = dict(ex.sent[0]["headers"])
    assert headers[b"retry-after"] == b"2"
    assert headers[REPLY_HEADER.encode()] == b"v=1, b=0, dnr, r=breaker-open, pb=1500"
    assert ex.sent[1]["body"] == b"askonce: breaker-open\n"


async def test_an_asgi_give_up_after_the_response_started_is_not_counted_as_a_503() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise askonce.BudgetExhausted("spent", reply=Reply(0, True, "exhausted"), layer="db", key=None, attempts=3)

    sent: list[Any] = []

    async def receive() -> Any:
        return {"type": "http.request", "body": b""}

    async def send(message: Any) -> None:
        sent.append(message)

    before = askonce.stats()
    with pytest.raises(askonce.BudgetExhausted):  # too late for a 503: the server cuts the response
        await AskonceASGIMiddleware(app, layer="api")({"type": "http", "method": "GET", "path": "/", "headers": []},
                                                      receive, send)
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [200]
    assert askonce.stats().get("server.gave-up.exhausted", 0) == before.get("server.gave-up.exhausted", 0)


# --- signed edge keys and thread-safe ledgers -----------------------------------------------------------

SECRET = b"0123456789abcdef0123"
OLD_SECRET = "an older secret, still accepted"


class LockProbe:
    """A ledger that says whether the process-wide LEDGER_LOCK was held while it recorded."""

    def __init__(self, thread_safe: bool) -> None:
        if thread_safe:
            self.thread_safe = True
        self.inner = Ledger(LedgerPolicy(window=DAY))
        self.held: list[bool] = []

    def record(self, now: float, operation: str, **kw: Any) -> bool:
        self.held.append(LEDGER_LOCK.locked())
        return self.inner.record(now, operation, **kw)


def signed_question(secret: bytes | str | None) -> dict[str, str]:
    key = askonce.propagation.new_key()
    sig = None if secret is None else askonce.core.signing.mac(key, secret)
    return {wire.QUESTION_HEADER: wire.format_question(key, "edge", True, 2, 5.0, (Hop("edge", 1),), sig)}


def test_an_edge_key_that_does_not_verify_is_recorded_as_unsigned_not_attributable() -> None:
    ledger = Ledger(LedgerPolicy(window=DAY))
    app = AskonceASGIMiddleware(make_app(Probe()), layer="target", ledger=ledger, edge_secret=[SECRET, OLD_SECRET])
    before = askonce.stats().get("ledger.edge.unsigned", 0)
    with running(app) as url, httpx.Client(base_url=url, timeout=5.0) as client:
        signed, old = signed_question(SECRET), signed_question(OLD_SECRET)
        forged = signed_question(b"not the originators' secret!")
        for headers in (signed, old, forged, signed_question(None)):
            r = client.get("/items/1", headers=headers)
            assert r.status_code == 200
            assert r.json()["edge"] is True  # the handler sees the question as it came; only the ledger judges
    with LEDGER_LOCK:
        op = ledger.report(time.time()).find("GET /items/{item_id}")
    assert op.attributable == 2  # signed with the current secret, and with the older one still accepted
    assert op.kinds[Kind.REMINTED] == 2 and op.reminted_by == {"~unsigned": 2}
    assert askonce.stats()["ledger.edge.unsigned"] == before + 2


def test_an_originator_with_an_edge_secret_signs_the_keys_it_mints() -> None:
    seen_sigs: list[Any] = []

    async def handler(scope: Any, receive: Any, send: Any) -> None:
        q = askonce.current()
        assert q is not None
        seen_sigs.append((q.key, q.edge, q.sig))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    app = AskonceASGIMiddleware(handler, layer="web", originator=True, edge_secret=(SECRET, OLD_SECRET))
    with running(app) as url:
        assert httpx.get(url + "/", timeout=5.0).status_code == 200
        assert httpx.get(url + "/", headers={QUESTION_HEADER: "v=9"}, timeout=5.0).status_code == 200
    for key, edge, sig in seen_sigs:  # minted with nothing sent, and in place of a malformed question
        assert edge and askonce.core.signing.verify_key(key, sig, SECRET)
        assert not askonce.core.signing.verify_key(key, sig, OLD_SECRET)  # the first secret signs


@pytest.mark.parametrize("thread_safe", [False, True])
def test_a_thread_safe_ledger_is_called_without_the_process_wide_lock(thread_safe: bool) -> None:
    ledger = LockProbe(thread_safe)
    app = AskonceASGIMiddleware(make_app(Probe()), layer="target", ledger=ledger)  # type: ignore[arg-type]
    with running(app) as url, httpx.Client(base_url=url, timeout=5.0) as client:
        for headers in (question(), {}):  # a keyed arrival, and an unkeyed one
            assert client.get("/items/1", headers=headers).status_code == 200
    assert ledger.held == [not thread_safe] * 2


@pytest.mark.parametrize("secret", [b"short", "", [], [SECRET, b"short"], 42, [42]])
def test_a_bad_edge_secret_is_refused_with_value_error(secret: Any) -> None:
    async def inner(scope: Any, receive: Any, send: Any) -> None: ...

    with pytest.raises(ValueError, match="edge_secret"):
        AskonceASGIMiddleware(inner, layer="api", edge_secret=secret)


# --- timers: one sweep per event loop -----------------------------------------------------------------


def sweep_timers(loop: asyncio.AbstractEventLoop) -> list[asyncio.TimerHandle]:
    """The sweep's timers still to fire on ``loop`` (cancelled ones wait in the heap until it turns)."""
    return [h for h in loop._scheduled  # type: ignore[attr-defined]
            if not h.cancelled() and getattr(h._callback, "__name__", "") == "visit"]


async def test_quick_requests_leave_no_timer_behind_and_slow_ones_are_still_cancelled_at_the_deadline() -> None:
    loop = asyncio.get_running_loop()
    mw = AskonceASGIMiddleware(sleepy, layer="api")

    async def quick(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    fast = AskonceASGIMiddleware(quick, layer="api")
    for _ in range(50):  # a deadline seconds away: nothing to arm for a request that is done at once
        ex = Exchange(question(deadline_ms=5000))
        await fast(ex.scope, ex.receive, ex.send)
        assert ex.sent[0]["status"] == 200
    assert len(sweep_timers(loop)) <= 1  # the one sweep of the loop
    ex = Exchange(question(deadline_ms=120))  # armed when the sweep comes by, 50-60 ms in
    started = loop.time()
    await mw(ex.scope, ex.receive, ex.send)
    assert ex.sent[0]["status"] == 503  # before sleepy's 0.2 s were up
    assert loop.time() - started >= 0.11  # and not before the deadline
    assert (REPLY_HEADER.encode(), b"v=1, b=2, dnr, r=deadline") in ex.sent[0]["headers"]


async def test_the_sweep_leaves_no_timer_to_wake_an_idle_loop_once_its_last_request_ends() -> None:
    loop = asyncio.get_running_loop()

    async def slow(scope: Any, receive: Any, send: Any) -> None:  # past the batch's visit
        await asyncio.sleep(3 * SWEEP_EVERY)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    mw = AskonceASGIMiddleware(slow, layer="api")
    # Visited while it runs: its deadline in the heap, its disconnect watch queued for later.
    ex = Exchange(question(deadline_ms=5000))
    task = asyncio.ensure_future(mw(ex.scope, ex.receive, ex.send))
    await asyncio.sleep(2 * SWEEP_EVERY)
    assert sweep_timers(loop)  # the sweep waits for its watch or its deadline
    await task
    assert ex.sent[0]["status"] == 200
    assert sweep_timers(loop) == []  # nothing runs: nothing to visit
    # Two at once: the first to end leaves the sweep to the other, which still has its deadline.
    exs = [Exchange(question(deadline_ms=5000)) for _ in range(2)]
    first = asyncio.ensure_future(mw(exs[0].scope, exs[0].receive, exs[0].send))
    await asyncio.sleep(SWEEP_EVERY)
    late = asyncio.ensure_future(AskonceASGIMiddleware(sleepy, layer="api")(
        exs[1].scope, exs[1].receive, exs[1].send))
    await first
    assert sweep_timers(loop)  # the second still runs
    await late
    assert [e.sent[0]["status"] for e in exs] == [200, 200]
    assert sweep_timers(loop) == []


def test_a_loop_stopped_with_requests_queued_for_the_sweep_can_be_collected() -> None:
    import gc
    import weakref

    async def hang(scope: Any, receive: Any, send: Any) -> None:
        await asyncio.sleep(3600)

    mw = AskonceASGIMiddleware(hang, layer="api")
    loop = asyncio.new_event_loop()
    ex = Exchange(question(deadline_ms=60_000))
    task = loop.create_task(mw(ex.scope, ex.receive, ex.send))
    loop.run_until_complete(asyncio.sleep(0.01))  # the request is running and queued for the sweep
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        loop.run_until_complete(task)
    loop.close()
    ref = weakref.ref(loop)
    del loop, task
    gc.collect()
    assert ref() is None


async def test_a_request_leaves_no_cycle_for_the_garbage_collector() -> None:
    import gc

    async def quick(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    mw = AskonceASGIMiddleware(quick, layer="api", ledger=Ledger(LedgerPolicy(window=DAY)))
    await asyncio.create_task(mw(*_args(Exchange(question()))))
    gc.collect()
    gc.disable()
    try:
        for headers in (question(), {}, {QUESTION_HEADER: "v=1, k=nope"}, question(deadline_ms=0)):
            await asyncio.create_task(mw(*_args(Exchange(headers))))  # a task per request, as servers run them
        assert gc.collect() == 0
    finally:
        gc.enable()


def _args(ex: Exchange) -> tuple[Any, Any, Any]:
    return ex.scope, ex.receive, ex.send


class Gate:
    """An app that holds every request until released (no timer of its own), then answers 200."""

    def __init__(self) -> None:
        self.open = asyncio.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.open.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


class CountingExchange(Exchange):
    def __init__(self, headers: dict[str, str] | None = None) -> None:
        super().__init__(headers)
        self.reads = 0

    async def receive(self) -> dict[str, Any]:
        self.reads += 1
        return await super().receive()


async def test_slow_requests_with_a_deadline_get_neither_a_timer_nor_a_task_of_their_own() -> None:
    loop = asyncio.get_running_loop()
    gate = Gate()
    mw = AskonceASGIMiddleware(gate, layer="api")
    scheduled = len(loop._scheduled)  # type: ignore[attr-defined]
    exchanges = [CountingExchange(question(deadline_ms=5000)) for _ in range(40)]
    tasks = [asyncio.create_task(mw(*_args(ex))) for ex in exchanges]
    tasks_before = len(asyncio.all_tasks())
    await asyncio.sleep(0.15)  # past the moment a request without a deadline gets its watcher
    assert len(asyncio.all_tasks()) == tasks_before  # no watcher task
    assert len(loop._scheduled) <= scheduled + 2  # type: ignore[attr-defined]  # the sweep and our sleep
    assert all(ex.reads == 0 for ex in exchanges)  # nothing read ahead of the app
    gate.open.set()
    await asyncio.gather(*tasks)
    assert all(ex.sent[0]["status"] == 200 for ex in exchanges)


async def test_a_slow_request_without_a_deadline_is_still_watched_for_a_disconnect() -> None:
    gate = Gate()
    mw = AskonceASGIMiddleware(gate, layer="api")
    ex = CountingExchange()  # no question: minted here, nothing says when the caller stops listening
    task = asyncio.create_task(mw(*_args(ex)))
    await asyncio.sleep(0.15)
    assert ex.reads >= 1  # the watcher reads ahead of the app
    gate.open.set()
    await task
    assert ex.sent[0]["status"] == 200


async def test_each_request_is_cancelled_at_its_own_deadline_whatever_the_order_they_came_in() -> None:
    loop = asyncio.get_running_loop()
    mw = AskonceASGIMiddleware(Gate(), layer="api")
    ended: dict[int, float] = {}

    async def one(deadline_ms: int) -> None:
        ex = Exchange(question(deadline_ms=deadline_ms))
        started = loop.time()
        await mw(*_args(ex))
        assert ex.sent[0]["status"] == 503
        assert loop.time() - started >= deadline_ms / 1000 - 0.005  # not before its deadline
        ended[deadline_ms] = loop.time()

    await asyncio.gather(*(one(ms) for ms in (300, 100, 200, 150)))
    assert sorted(ended, key=ended.__getitem__) == [100, 150, 200, 300]


async def test_ended_requests_do_not_pile_up_behind_one_that_runs_on() -> None:
    from askonce.integrations.asgi import _sweeps

    async def quick(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    gate = Gate()
    hold = asyncio.create_task(AskonceASGIMiddleware(gate, layer="api")(
        *_args(Exchange(question(deadline_ms=1000)))))  # the earliest deadline, first in the heap
    await asyncio.sleep(0)
    fast = AskonceASGIMiddleware(quick, layer="api")
    for _ in range(2000):
        await fast(*_args(Exchange(question(deadline_ms=60_000))))
    sweep = _sweeps[asyncio.get_running_loop()]
    assert sweep.live == 1
    assert len(sweep.deadlines) <= 2 * sweep.live + 65
    gate.open.set()
    await hold
    assert sweep.live == 0


async def test_deadlines_hold_on_a_loop_whose_timer_handles_cannot_be_weakly_referenced() -> None:
    loop = asyncio.get_running_loop()

    class Handle:
        __slots__ = ("handle",)  # no __weakref__

        def __init__(self, handle: asyncio.TimerHandle) -> None:
            self.handle = handle

        def cancel(self) -> None:
            self.handle.cancel()

    original = loop.call_later
    loop.call_later = lambda *a, **k: Handle(original(*a, **k))  # type: ignore[assignment,method-assign,return-value]
    try:
        mw = AskonceASGIMiddleware(Gate(), layer="api")
        exchanges = [Exchange(question(deadline_ms=ms)) for ms in (200, 100)]  # the second re-arms
        await asyncio.gather(*(mw(*_args(ex)) for ex in exchanges))
    finally:
        del loop.call_later  # type: ignore[method-assign]
    assert [ex.sent[0]["status"] for ex in exchanges] == [503, 503]
    assert loop.call_later == original


async def test_with_the_clock_swapped_a_handler_is_still_cancelled_when_its_time_runs_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    frozen = askonce._stats.monotonic()
    monkeypatch.setattr(askonce._stats, "monotonic", lambda: frozen)  # a test's clock, standing still
    ex = Exchange(question(deadline_ms=100))
    await asyncio.wait_for(AskonceASGIMiddleware(Gate(), layer="api")(*_args(ex)), 5)
    assert ex.sent[0]["status"] == 503  # the 100 ms it was given ran out on the loop's clock


@pytest.mark.parametrize("detached", [False, True])
async def test_at_a_joining_layer_a_request_with_a_deadline_is_watched_unless_others_may_join_it(
        detached: bool) -> None:
    # Toward a joining callee the clients send the question's whole time, longer than they wait.
    from askonce.integrations._join import announce, detach

    gate = Gate()

    async def joining(scope: Any, receive: Any, send: Any) -> None:
        announce()
        if detached:
            detach()  # a run others may join: its caller going away does not cancel it
        await gate(scope, receive, send)

    ex = CountingExchange(question(deadline_ms=5000))
    task = asyncio.create_task(AskonceASGIMiddleware(joining, layer="api")(*_args(ex)))
    await asyncio.sleep(0.15)
    assert (ex.reads >= 1) is not detached  # the watcher reads ahead of the app
    gate.open.set()
    await task
    assert ex.sent[0]["status"] == 200


async def test_many_slow_requests_each_end_at_their_own_deadline_and_leave_nothing_behind() -> None:
    import random

    from askonce.integrations.asgi import _sweeps

    loop = asyncio.get_running_loop()
    scheduled = len(loop._scheduled)  # type: ignore[attr-defined]
    gate = Gate()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        frame = askonce._context.current_frame()
        assert frame is not None
        scope["deadline"] = frame[0].deadline  # as the middleware read it, on askonce's clock
        await gate(scope, receive, send)

    mw = AskonceASGIMiddleware(app, layer="api")
    deadlines = [100 + 2 * i for i in range(150)]  # ms
    random.Random(7).shuffle(deadlines)
    ended: list[float] = []  # each request's deadline, in the order they ended

    async def one(deadline_ms: int) -> None:
        ex = Exchange(question(deadline_ms=deadline_ms))
        started = loop.time()
        await mw(*_args(ex))
        assert ex.sent[0]["status"] == 503
        assert (REPLY_HEADER.encode(), b"v=1, b=2, dnr, r=deadline") in ex.sent[0]["headers"]
        assert loop.time() - started >= deadline_ms / 1000 - 0.005  # not before its deadline
        if "deadline" in ex.scope:  # else refused on arrival (past its deadline on a busy machine)
            ended.append(ex.scope["deadline"])

    tasks_before = len(asyncio.all_tasks())
    await asyncio.wait_for(asyncio.gather(*(one(ms) for ms in deadlines), *(
        one(ms) for ms in (1, 3, 5))), 30)  # and three due before the batch is taken in
    assert sorted(ended) == ended  # each at its own deadline, in their order
    assert len(ended) >= 150
    sweep = _sweeps[loop]
    assert sweep.live == 0 and not sweep.deadlines and not sweep.polled
    assert not sweep.batch or not any(ex.running for ex in sweep.batch)
    assert all(ex is None for _, batch in sweep.due for ex in batch)
    assert len(asyncio.all_tasks()) == tasks_before  # no watcher task was started
    assert len(loop._scheduled) <= scheduled + 1  # type: ignore[attr-defined]  # the sweep's timer


def test_under_uvicorn_a_disconnect_among_many_cancels_only_its_own_handler_with_no_watcher_task() -> None:
    # With no deadline sent, every request is watched for a disconnect; under uvicorn the sweep reads
    # the server's own flag, so no request gets a task reading receive() for it.
    probe = Probe()
    app = FastAPI()

    @app.get("/hold")
    async def hold(id: str) -> str:
        probe.event(f"{id}.started").set()
        try:
            for i in range(500):  # 10 s at most
                await asyncio.sleep(0.02)
                if i == 10:  # past WATCH_AFTER: each request is watched by now
                    probe.seen[id] = sum(1 for t in asyncio.all_tasks()
                                         if getattr(t.get_coro(), "__qualname__", "").endswith("_pump"))
                if probe.event("release").is_set():
                    break
        except asyncio.CancelledError:
            probe.event(f"{id}.cancelled").set()
            raise
        probe.calls["done"] += 1
        return "done"

    app.add_middleware(AskonceASGIMiddleware, layer="api")
    before = askonce.stats().get("server.cancelled.disconnect", 0)
    with running(app) as url:
        port = int(url.rsplit(":", 1)[1])
        socks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(5)]
        try:
            for i, sock in enumerate(socks):
                sock.sendall(f"GET /hold?id=r{i} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            for i in range(5):
                assert probe.event(f"r{i}.started").wait(10)
            deadline = time.monotonic() + 10
            while len(probe.seen) < 5 and time.monotonic() < deadline:
                time.sleep(0.02)
            socks[2].close()  # this one's client goes away
            assert probe.event("r2.cancelled").wait(10)
            probe.event("release").set()
            for i in (0, 1, 3, 4):
                assert socks[i].recv(4096).startswith(b"HTTP/1.1 200")
        finally:
            for sock in socks:
                sock.close()
    assert probe.calls["done"] == 4
    assert not any(probe.event(f"r{i}.cancelled").is_set() for i in (0, 1, 3, 4))
    assert probe.seen == {f"r{i}": 0 for i in range(5)}  # no watcher task for any of them
    assert askonce.stats()["server.cancelled.disconnect"] == before + 1
