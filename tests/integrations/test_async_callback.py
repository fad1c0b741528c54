"""Signed callbacks of async mode on real servers on 127.0.0.1: a joining callee asked
``Prefer: respond-async`` with ``askonce-callback`` POSTs the answer there once, signed; a
``CallbackReceiver`` verifies it and hands it to whoever awaits it; a URL the callee does not
allow is never contacted; WSGI async mode; two replicas behind one Redis."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import askonce
from askonce import RetryPolicy
from askonce.client import ClientPolicy
from askonce.core.callback import CallbackError
from askonce.core.wire import QUESTION_HEADER, format_question
from askonce.integrations.asgi import AskonceASGIMiddleware
from askonce.integrations.asgi_join import JoinASGIMiddleware
from askonce.integrations.callbacks import TRIES, CallbackReceiver, verify_callback
from askonce.integrations.httpx import AsyncAskonceTransport
from askonce.integrations.wsgi import AskonceWSGIMiddleware
from askonce.integrations.wsgi_join import JoinWSGIMiddleware
from askonce.propagation import new_key
from askonce.stores.join_redis import RedisJoinStore
from e2e_services import uvicorn_running, waitress_running
from redis_server import RedisServer
from stats_delta import delta

SECRET = b"callback-secret-0123456789"
JOINED = "askonce-joined"


class Slow:
    """Takes ``seconds`` per run, counts its runs per question key."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.runs: Counter[str] = Counter()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = (await receive()).get("body", b"")
        q = askonce.current()
        self.runs[q.key if q is not None else "-"] += 1
        await asyncio.sleep(self.seconds)
        await send({"type": "http.response.start", "status": 201,
                    "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"made " + body})


class Recorded:
    """An ASGI app in front of another that keeps every request it got (headers, body)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.got: list[tuple[list[tuple[bytes, bytes]], bytes]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        message = await receive()
        self.got.append((list(scope["headers"]), message.get("body", b"")))

        async def again() -> dict[str, Any]:
            return message

        await self.app(scope, again, send)


class Listener:
    """A socket on 127.0.0.1 that counts the connections made to it (and answers none)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.05)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()


@pytest.fixture
def listener() -> Iterator[Listener]:
    it = Listener()
    yield it
    it.close()


def _callee(handler: Any, hooks: str | None, **options: Any) -> Any:
    allow = None if hooks is None else (hooks,)
    join = JoinASGIMiddleware(handler, callbacks=allow, callback_secret=SECRET, **options)
    return AskonceASGIMiddleware(join, layer="callee")


def _ask(key: str, callback: str | None, deadline: float = 30.0) -> dict[str, str]:
    headers = {QUESTION_HEADER: format_question(key, "edge", True, 2, deadline),
               "prefer": "respond-async"}
    if callback is not None:
        headers["askonce-callback"] = callback
    return headers


def test_the_answer_is_posted_once_signed_and_verifiable_beside_the_status_location() -> None:
    handler, key = Slow(0.5), new_key()
    receiver = CallbackReceiver(SECRET)
    recorded = Recorded(receiver)
    before = askonce.stats()
    with uvicorn_running(recorded) as hooks, \
            uvicorn_running(_callee(handler, hooks + "/hooks/")) as url, \
            httpx.Client(base_url=url, timeout=20.0) as c:
        first = c.post("/orders", content=b"one", headers=_ask(key, hooks + "/hooks/a"))
        again = c.post("/orders", content=b"one", headers=_ask(key, hooks + "/hooks/a"))
        assert first.status_code == again.status_code == 202
        got = asyncio.run(receiver.answer(key, 20.0))
        polled = c.get(first.headers["location"], headers={"prefer": "wait=20"})
    assert (got.key, got.status, got.body, got.content_type) == (key, 201, b"made one",
                                                                 "text/plain")
    assert got.location == first.headers["location"]
    assert polled.status_code == 201 and polled.text == "made one"  # the GET works beside it
    assert handler.runs[key] == 1 and len(recorded.got) == 1  # once, though asked twice
    assert delta(before).get("server.join.callback.sent") == 1
    # What came over the wire verifies with the secret, and not once anything is changed.
    headers, body = recorded.got[0]
    now = time.time()
    assert verify_callback(headers, body, SECRET, now).body == b"made one"
    with pytest.raises(CallbackError) as tampered:
        verify_callback(headers, body + b"!", SECRET, now)
    assert tampered.value.reason == "signature"
    with pytest.raises(CallbackError) as forged:
        verify_callback(headers, body, b"another-secret-0123456789", now)
    assert forged.value.reason == "signature"
    with pytest.raises(CallbackError) as old:
        verify_callback(headers, body, SECRET, now + 301.0, max_age=300.0)
    assert old.value.reason == "stale"
    with pytest.raises(CallbackError) as twice:
        verify_callback([*headers, (b"askonce-callback-status", b"200")], body, SECRET, now)
    assert twice.value.reason == "repeated"


@pytest.mark.parametrize("allow", [None, "other"])
def test_a_callback_url_the_callee_does_not_allow_is_never_contacted(
        listener: Listener, allow: str | None) -> None:
    handler, key = Slow(0.1), new_key()
    hooks = None if allow is None else "http://127.0.0.1:1/hooks/"
    before = askonce.stats()
    with uvicorn_running(_callee(handler, hooks)) as url, \
            httpx.Client(base_url=url, timeout=20.0) as c:
        sneaky = f"http://127.0.0.1:{listener.port}/hooks/a"
        accepted = c.post("/x", headers=_ask(key, sneaky))
        assert accepted.status_code == 202  # async mode goes on; the callback is not taken
        done = c.get(accepted.headers["location"], headers={"prefer": "wait=20"})
        assert done.status_code == 201
        time.sleep(0.5)  # what a delivery would have needed to connect
    assert listener.connections == 0
    moved = delta(before)
    assert moved.get("server.join.callback.refused") == 1
    assert "server.join.callback.sent" not in moved and "server.join.callback.failed" not in moved


def test_a_receiver_that_keeps_failing_is_tried_a_bounded_number_of_times() -> None:
    tries: list[int] = []

    async def failing(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await receive()
        tries.append(1)
        await send({"type": "http.response.start", "status": 503, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    handler, key = Slow(0.0), new_key()
    before = askonce.stats()
    with uvicorn_running(failing) as hooks, \
            uvicorn_running(_callee(handler, hooks + "/")) as url:
        r = httpx.post(url + "/x", headers=_ask(key, hooks + "/h"), timeout=20.0)
        assert r.status_code == 202
        limit = time.monotonic() + 30
        while "server.join.callback.gave-up" not in delta(before) and time.monotonic() < limit:
            time.sleep(0.05)
    moved = delta(before)
    assert len(tries) == TRIES and moved["server.join.callback.failed"] == TRIES
    assert moved["server.join.callback.gave-up"] == 1 and "server.join.callback.sent" not in moved


def test_a_run_that_ends_without_an_answer_says_so_by_callback() -> None:
    handler, key = Slow(30.0), new_key()
    receiver = CallbackReceiver(SECRET)
    with uvicorn_running(receiver) as hooks, \
            uvicorn_running(_callee(handler, hooks + "/")) as url:
        r = httpx.post(url + "/x", headers=_ask(key, hooks + "/h", deadline=0.5), timeout=20.0)
        assert r.status_code == 202
        got = asyncio.run(receiver.answer(key, 20.0))
    assert got.status == 504 and got.body == b"" and handler.runs[key] == 1


def test_the_receiver_refuses_what_is_not_signed_and_stays_bounded() -> None:
    receiver = CallbackReceiver(SECRET, max_pending=2)
    key = new_key()
    before = askonce.stats()
    with uvicorn_running(receiver) as hooks, httpx.Client(base_url=hooks, timeout=20.0) as c:
        assert c.post("/", content=b"x").status_code == 400
        forged = {"askonce-callback-key": key, "askonce-callback-location": "/x",
                  "askonce-callback-status": "200", "askonce-callback-timestamp":
                  str(int(time.time())), "askonce-callback-signature": "AAAA"}
        assert c.post("/", content=b"x", headers=forged).status_code == 401
        assert c.get("/").status_code == 405
        with pytest.raises(TimeoutError):
            asyncio.run(receiver.answer(key, 0.2))  # nothing was resolved
    assert len(receiver) == 0

    async def fill() -> None:
        waiting = [asyncio.create_task(receiver.answer(new_key(), 20.0)) for _ in range(2)]
        await asyncio.sleep(0)
        assert len(receiver) == 2
        with pytest.raises(LookupError):
            await receiver.answer(new_key(), 1.0)  # a third pending key: the table is full
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)

    asyncio.run(fill())
    assert len(receiver) == 0  # the cancelled waits left nothing behind
    moved = delta(before)
    assert moved["callback.refused.missing"] == 1 and moved["callback.refused.signature"] == 1
    assert moved["callback.full"] == 1


# --- WSGI async mode ------------------------------------------------------------------------------


class Work:
    """A WSGI handler that takes ``seconds``, counting its runs per question key."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.runs: Counter[str] = Counter()
        self.lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Any) -> list[bytes]:
        body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
        q = askonce.current()
        with self.lock:
            self.runs[q.key if q is not None else "-"] += 1
        time.sleep(self.seconds)
        start_response("201 Created", [("Content-Type", "text/plain")])
        return [b"made " + body]


def _user(request: dict[str, Any]) -> str:
    return str(request.get("HTTP_X_USER", ""))


def _wsgi_callee(work: Work, hooks: str | None = None, **options: Any) -> Any:
    join = JoinWSGIMiddleware(work, principal=_user, callbacks=None if hooks is None else (hooks,),
                              callback_secret=SECRET, **options)
    return AskonceWSGIMiddleware(join, layer="callee")


def test_wsgi_async_mode_answers_at_the_status_location_and_by_callback() -> None:
    work, key = Work(0.5), new_key()
    receiver = CallbackReceiver(SECRET)
    recorded = Recorded(receiver)
    with uvicorn_running(recorded) as hooks, \
            waitress_running(_wsgi_callee(work, hooks + "/")) as url, \
            httpx.Client(base_url=url, timeout=20.0) as c:
        asked = {**_ask(key, hooks + "/h"), "x-user": "alice"}
        accepted = c.post("/orders", content=b"one", headers=asked)
        assert accepted.status_code == 202 and accepted.headers["preference-applied"]
        where = accepted.headers["location"]
        assert c.post("/orders", content=b"one", headers=asked).headers["location"] == where
        assert c.get(where, headers={"x-user": "mallory", "prefer": "wait=1"}).status_code == 404
        done = c.get(where, headers={"x-user": "alice", "prefer": "wait=20"})
        got = asyncio.run(receiver.answer(key, 20.0))
        late = c.post("/orders", content=b"one", headers=asked)
    assert done.status_code == 201 and done.text == "made one" and done.headers[JOINED] == "replay"
    assert (got.status, got.body, got.location) == (201, b"made one", where)
    assert late.status_code == 201 and late.headers[JOINED] == "replay"
    assert work.runs[key] == 1 and len(recorded.got) == 1


def test_wsgi_past_max_background_the_question_runs_inline(listener: Listener) -> None:
    work, key = Work(0.0), new_key()
    hooks = f"http://127.0.0.1:{listener.port}/"
    with waitress_running(_wsgi_callee(work, hooks, max_background=0)) as url:
        r = httpx.post(url + "/x", content=b"x", headers=_ask(key, hooks + "h"), timeout=20.0)
    assert r.status_code == 201 and "preference-applied" not in r.headers
    assert work.runs[key] == 1 and listener.connections == 0  # answered inline: no callback


# --- across replicas: one Redis -------------------------------------------------------------------


def test_asgi_replicas_asked_at_one_answer_at_the_status_location_of_the_other(
        shared_redis: RedisServer) -> None:
    handler, key = Slow(0.5), new_key()
    receiver = CallbackReceiver(SECRET)
    recorded = Recorded(receiver)

    def replica(hooks: str) -> Any:
        store = RedisJoinStore(shared_redis.url, lease=2.0)
        join = JoinASGIMiddleware(handler, store=store, callbacks=(hooks,),
                                  callback_secret=SECRET,
                                  principal=lambda s: dict(s["headers"]).get(b"x-user", b"")
                                  .decode())
        return AskonceASGIMiddleware(join, layer="callee")

    with uvicorn_running(recorded) as hooks, uvicorn_running(replica(hooks + "/")) as a, \
            uvicorn_running(replica(hooks + "/")) as b:
        asked = {**_ask(key, hooks + "/h"), "x-user": "alice"}
        accepted = httpx.post(a + "/orders", content=b"one", headers=asked, timeout=20.0)
        assert accepted.status_code == 202
        where = accepted.headers["location"]
        running = httpx.get(b + where, headers={"x-user": "alice"}, timeout=20.0)
        other = httpx.get(b + where, headers={"x-user": "mallory", "prefer": "wait=1"},
                          timeout=20.0)
        done = httpx.get(b + where, headers={"x-user": "alice", "prefer": "wait=20"},
                         timeout=30.0)
        got = asyncio.run(receiver.answer(key, 20.0))
        again = httpx.post(b + "/orders", content=b"one", headers=asked, timeout=20.0)
    assert running.status_code in (202, 201) and other.status_code == 404
    assert done.status_code == 201 and done.text == "made one" and done.headers[JOINED] == "replay"
    assert again.status_code == 201 and again.headers[JOINED] == "replay"
    assert (got.status, got.body) == (201, b"made one") and len(recorded.got) == 1
    assert handler.runs[key] == 1


def test_wsgi_replicas_asked_at_one_answer_at_the_status_location_of_the_other(
        shared_redis: RedisServer) -> None:
    work, key = Work(0.5), new_key()

    def replica() -> Any:
        return _wsgi_callee(work, store=RedisJoinStore(shared_redis.url, lease=2.0))

    with waitress_running(replica()) as a, waitress_running(replica()) as b:
        asked = {**_ask(key, None), "x-user": "alice"}
        accepted = httpx.post(a + "/orders", content=b"one", headers=asked, timeout=20.0)
        assert accepted.status_code == 202
        where = accepted.headers["location"]
        joined = httpx.post(b + "/orders", content=b"one", headers=asked, timeout=20.0)
        other = httpx.get(b + where, headers={"x-user": "mallory"}, timeout=20.0)
        done = httpx.get(b + where, headers={"x-user": "alice", "prefer": "wait=20"},
                         timeout=30.0)
    assert joined.status_code in (202, 201) and other.status_code == 404
    assert done.status_code == 201 and done.text == "made one"
    assert work.runs[key] == 1


# --- end to end: edge -> middle -> target, every timeout 1 s, the target taking 5 s ---------------

TIMEOUT = 1.0  # every layer's timeout, per call
WORK = 5.0  # seconds the target takes


class Target:
    """The target: 5 s of work per run on ``/work`` (at once on ``/ok``), runs counted per key."""

    def __init__(self) -> None:
        self.runs: Counter[str] = Counter()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        q = askonce.current()
        if scope["path"] == "/work":
            self.runs[q.key if q is not None else "-"] += 1
            await asyncio.sleep(WORK)
        body = b"worked for " + (q.key.encode() if q is not None else b"-")
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": body})


def _middle(target: str) -> Any:
    """The middle service: asks the target in async mode (each call within 1 s) and long-polls
    its status location (each GET within 1 s) until the answer is there."""
    policy = ClientPolicy(layer="middle", retry=RetryPolicy(attempts=3), bucket=None,
                          admission=None)

    async def middle(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        end = asyncio.get_running_loop().time() + 20.0
        async with httpx.AsyncClient(transport=AsyncAskonceTransport(policy=policy),
                                     timeout=TIMEOUT) as http, \
                httpx.AsyncClient(timeout=TIMEOUT) as poll:
            r = await http.post(target + "/work", headers={"prefer": "respond-async"})
            where = r.headers.get("location", "")
            while r.status_code == 202 and asyncio.get_running_loop().time() < end:
                await asyncio.sleep(0.2)
                with contextlib.suppress(httpx.TimeoutException):  # a GET is safe to repeat
                    r = await poll.get(target + where, headers={"prefer": "wait=0"})
        await send({"type": "http.response.start", "status": r.status_code,
                    "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"middle: " + r.content})

    return middle


async def test_end_to_end_the_answer_arrives_once_by_callback_and_the_target_works_once() -> None:
    target = Target()
    receiver = CallbackReceiver(SECRET)
    recorded = Recorded(receiver)
    keys = [new_key() for _ in range(3)]
    before = askonce.stats()
    with uvicorn_running(recorded) as edge_hooks, \
            uvicorn_running(AskonceASGIMiddleware(JoinASGIMiddleware(target),
                                                  layer="target")) as target_url, \
            uvicorn_running(_callee(_middle(target_url), edge_hooks + "/hooks/")) as middle_url:
        # The middle has heard the target join before (its replies say j): toward it a call is
        # given the question's whole time left, not the 1 s the middle waits for each call.
        with askonce.question(budget=2, deadline=20.0):
            async with httpx.AsyncClient(transport=AsyncAskonceTransport(),
                                         timeout=TIMEOUT) as warm:
                assert (await warm.get(target_url + "/ok")).status_code == 200
        async with httpx.AsyncClient(timeout=TIMEOUT) as edge:
            asked = await asyncio.gather(*(edge.post(
                middle_url + "/ask", headers=_ask(key, edge_hooks + "/hooks/edge", 20.0))
                for key in keys))
            assert [r.status_code for r in asked] == [202] * len(keys)
            got = await asyncio.gather(*(receiver.answer(key, 30.0) for key in keys))
    for key, callback in zip(keys, got, strict=True):
        assert callback.status == 200 and callback.body == b"middle: worked for " + key.encode()
        assert target.runs[key] == 1  # once per question, though every timeout is 1 s
    assert len(recorded.got) == len(keys)  # each answer once by callback
    moved = delta(before)
    assert moved["server.join.callback.sent"] == len(keys)
    assert "callback.duplicate" not in moved


async def test_end_to_end_without_askonce_the_same_stack_times_out_and_multiplies_the_work(
        ) -> None:
    runs: Counter[str] = Counter()

    async def target(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await receive()
        runs[dict(scope["headers"]).get(b"x-request-id", b"-").decode()] += 1
        await asyncio.sleep(WORK)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"worked"})

    def naive_middle(target_url: str) -> Any:
        async def middle(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                return
            await receive()
            rid = dict(scope["headers"]).get(b"x-request-id", b"-")
            status = 504
            async with httpx.AsyncClient(timeout=TIMEOUT) as http:
                for _ in range(3):  # three tries, each within 1 s
                    try:
                        status = (await http.get(target_url + "/work",
                                                 headers={"x-request-id": rid.decode()})
                                  ).status_code
                        break
                    except httpx.TimeoutException:
                        continue
            await send({"type": "http.response.start", "status": status, "headers": []})
            await send({"type": "http.response.body", "body": b""})

        return middle

    with uvicorn_running(target) as target_url, \
            uvicorn_running(naive_middle(target_url)) as middle_url:
        async with httpx.AsyncClient(timeout=TIMEOUT) as edge:
            answered = 0
            for _ in range(3):  # the edge's three tries
                try:
                    r = await edge.get(middle_url + "/ask", headers={"x-request-id": "q1"})
                    answered += r.status_code == 200
                except httpx.TimeoutException:
                    continue
        limit = time.monotonic() + 30
        while runs["q1"] < 3 and time.monotonic() < limit:
            await asyncio.sleep(0.05)  # the middles still trying after the edge left
    assert answered == 0  # no answer within any 1 s timeout
    assert runs["q1"] >= 3  # one question, the target's 5 s of work begun again and again


# --- the receiver's table, in-process (its ASGI app called directly) ---------------------------


async def _deliver(receiver: CallbackReceiver, key: str, body: bytes = b"hi") -> int:
    from askonce.core.callback import sign

    headers = {**sign(SECRET, key, "/loc", 200, "text/plain", int(time.time()), body),
               "content-type": "text/plain"}
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/hooks/x",
             "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}
    await receiver(scope, receive, send)
    return int(sent[0]["status"])


async def test_an_acknowledged_callback_survives_a_waiter_that_timed_out_in_the_same_turn() -> None:
    receiver, key = CallbackReceiver(SECRET), new_key()
    waiter = asyncio.ensure_future(receiver.answer(key, 0.05))
    await asyncio.sleep(0)  # registered
    time.sleep(0.1)  # the loop is busy past the waiter's timeout; the callback comes now
    assert await _deliver(receiver, key) == 204
    with contextlib.suppress(TimeoutError):
        await waiter
    # Whether that waiter got it or timed out, the sender was told 204: the answer is not lost.
    if waiter.cancelled() or waiter.exception() is not None:
        assert (await receiver.answer(key, 1.0)).body == b"hi"


async def test_a_long_waiter_does_not_keep_expired_answers_from_being_evicted() -> None:
    receiver = CallbackReceiver(SECRET, max_pending=3, keep=0.1)
    waiting = asyncio.ensure_future(receiver.answer(new_key(), 5.0))
    await asyncio.sleep(0)
    assert await _deliver(receiver, new_key()) == 204  # nobody asks for these two
    assert await _deliver(receiver, new_key()) == 204
    await asyncio.sleep(0.3)  # past keep
    assert await _deliver(receiver, new_key()) == 204  # room made past the waiter
    waiting.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await waiting
