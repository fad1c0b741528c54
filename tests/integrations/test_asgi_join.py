"""JoinASGIMiddleware on a real uvicorn server: one handler run per question, every arrival counted.

The callee is ``AskonceASGIMiddleware(JoinASGIMiddleware(app), ledger=...)``: the ledger sees every
arrival, the handler runs once per question while it is in flight or its answer is kept.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import Counter
from typing import Any

import httpx

import askonce
from asgi_body import read_body
from askonce.core.join import JoinPolicy
from askonce.core.ledger import Ledger, LedgerPolicy
from askonce.core.wire import QUESTION_HEADER, format_question
from askonce.integrations.asgi import AskonceASGIMiddleware
from askonce.integrations.asgi_join import JOINED_HEADER, JoinASGIMiddleware
from askonce.propagation import new_key
from e2e_services import uvicorn_running


class Handler:
    """Counts runs per key; ``/slow`` takes 0.3 s, ``/fail`` answers 503, ``/big`` 2 kB."""

    def __init__(self) -> None:
        self.runs: Counter[str] = Counter()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = await read_body(receive)
        q = askonce.current()
        self.runs[q.key if q is not None else "-"] += 1
        path = scope["path"]
        if path == "/slow":
            await asyncio.sleep(0.3)
        status = 503 if path == "/fail" else 200
        out = b"x" * 2048 if path == "/big" else b"answer to " + body
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": out})


DAY = 86_400.0  # one ledger window for the whole run: no window boundary in the middle of a test


def _stack(**join: Any) -> tuple[Handler, Ledger, Any]:
    handler, ledger = Handler(), Ledger(LedgerPolicy(window=DAY))
    app = AskonceASGIMiddleware(JoinASGIMiddleware(handler, **join), layer="target", ledger=ledger)
    return handler, ledger, app


def _header(key: str) -> dict[str, str]:
    return {QUESTION_HEADER: format_question(key, "edge", True, 2, 10.0)}


def _arrivals(ledger: Ledger) -> int:
    return sum(op.arrivals for op in ledger.report(now=time.time()).operations)


def test_repeated_arrivals_in_flight_wait_for_the_one_run_and_a_late_one_is_replayed() -> None:
    handler, ledger, app = _stack()
    key = new_key()
    with uvicorn_running(app) as url, concurrent.futures.ThreadPoolExecutor(5) as pool:
        rs = list(pool.map(lambda _: httpx.post(url + "/slow", content=b"q", headers=_header(key),
                                                timeout=10.0), range(5)))
        late = httpx.post(url + "/slow", content=b"q", headers=_header(key), timeout=10.0)
    assert handler.runs[key] == 1
    assert [r.status_code for r in rs] == [200] * 5 and {r.text for r in rs} == {"answer to q"}
    assert sorted(r.headers.get(JOINED_HEADER.decode(), "run") for r in rs).count("wait") == 4
    assert late.status_code == 200 and late.headers[JOINED_HEADER.decode()] == "replay"
    assert late.text == "answer to q"
    assert "askonce-reply" in late.headers  # the outer middleware answers every arrival
    assert _arrivals(ledger) == 6  # the ledger counts every arrival, the handler ran once
    # ...and says so beside them: 6 arrivals for the question, 1 run (5 were answered by it).
    (op,) = ledger.report(now=time.time()).operations
    assert (op.amplification, op.joined, op.work_per_question) == (6.0, 5, 1.0)


def test_another_request_under_the_same_key_is_refused() -> None:
    handler, _, app = _stack()
    key = new_key()
    with uvicorn_running(app) as url:
        first = httpx.post(url + "/x", content=b"pay 10", headers=_header(key), timeout=10.0)
        other = httpx.post(url + "/x", content=b"pay 1000", headers=_header(key), timeout=10.0)
    assert first.status_code == 200 and other.status_code == 422
    assert handler.runs[key] == 1


def test_a_failed_answer_is_not_replayed_so_a_retry_really_runs() -> None:
    handler, _, app = _stack()
    key = new_key()
    with uvicorn_running(app) as url:
        a = httpx.get(url + "/fail", headers=_header(key), timeout=10.0)
        b = httpx.get(url + "/fail", headers=_header(key), timeout=10.0)
    assert a.status_code == b.status_code == 503
    assert handler.runs[key] == 2


def test_minted_questions_too_large_answers_and_principals_are_never_joined() -> None:
    handler, _, app = _stack(policy=JoinPolicy(max_body=1024),
                             principal=lambda scope: dict(scope["headers"]).get(b"x-user", b"").decode())
    key = new_key()
    with uvicorn_running(app) as url:
        for _ in range(2):
            httpx.get(url + "/x", timeout=10.0)  # no question: this layer mints, nothing to join
            httpx.get(url + "/big", headers=_header(key), timeout=10.0)  # over max_body: not kept
        for user in ("alice", "bob"):
            httpx.get(url + "/x", headers={**_header(key), "x-user": user}, timeout=10.0)
    assert sum(n for k, n in handler.runs.items() if k != key) == 2
    assert handler.runs[key] == 2 + 2  # /big twice, then one run per principal


def test_distinct_keys_in_a_flood_stay_bounded() -> None:
    handler, _, app = _stack(policy=JoinPolicy(max_entries=50))
    with uvicorn_running(app) as url, httpx.Client(base_url=url, timeout=10.0) as c:
        for _ in range(300):
            assert c.get("/x", headers=_header(new_key())).status_code == 200
        joins = app.app.joins
    assert len(joins) <= 50 and sum(handler.runs.values()) == 300


# --- in process: what a server cannot easily be made to do ------------------------------------------


def _call(app: Any, key: str, path: str, messages: list[dict[str, Any]], method: str = "POST"
          ) -> tuple[int | None, bytes]:
    async def go() -> tuple[int | None, bytes]:
        scope = {"type": "http", "method": method, "path": path, "query_string": b"",
                 "headers": [(QUESTION_HEADER.encode(), format_question(key, "edge", True, 2, 10.0).encode())]}
        pending = list(messages)
        out: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            if pending:
                return pending.pop(0)
            await asyncio.sleep(3600)
            raise AssertionError("unreachable")

        async def send(message: dict[str, Any]) -> None:
            out.append(message)

        await app(scope, receive, send)
        status = next((m["status"] for m in out if m["type"] == "http.response.start"), None)
        return status, b"".join(m.get("body", b"") for m in out if m["type"] == "http.response.body")

    return asyncio.run(go())


class _Echo:
    def __init__(self) -> None:
        self.runs = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        self.runs += 1
        if scope["path"] == "/slow":
            await asyncio.sleep(0.3)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"got " + body})


def test_a_body_cut_short_by_a_disconnect_is_not_joined_so_the_retry_runs() -> None:
    echo = _Echo()
    app = AskonceASGIMiddleware(JoinASGIMiddleware(echo), layer="callee")
    key = new_key()
    _call(app, key, "/orders", [{"type": "http.request", "body": b"hal", "more_body": True},
                                {"type": "http.disconnect"}])
    status, body = _call(app, key, "/orders", [{"type": "http.request", "body": b"half+rest"}])
    assert (status, body) == (200, b"got half+rest") and echo.runs == 2


def test_a_waiter_on_another_event_loop_runs_unjoined_instead_of_hanging() -> None:
    echo = _Echo()
    app = AskonceASGIMiddleware(JoinASGIMiddleware(echo), layer="callee")
    key = new_key()
    results: list[tuple[int | None, bytes]] = []
    first = threading.Thread(target=lambda: results.append(
        _call(app, key, "/slow", [{"type": "http.request", "body": b"x"}])))
    first.start()
    time.sleep(0.1)  # the first run is in flight on the first thread's loop
    second = threading.Thread(target=lambda: results.append(
        _call(app, key, "/slow", [{"type": "http.request", "body": b"x"}])))
    second.start()
    first.join(10)
    second.join(10)
    assert not first.is_alive() and not second.is_alive()
    assert [r[0] for r in results] == [200, 200]
    assert echo.runs in (1, 2)  # 2 when they overlapped (the usual case); 1 if the first was done


def test_the_reply_says_joins_with_what_is_left_and_a_noted_give_up_keeps_its_reason() -> None:
    from askonce.core.wire import REPLY_HEADER, Reply, parse_reply
    from askonce.errors import attach_reply
    from askonce.integrations.asgi import note_failure

    async def noted(scope: dict[str, Any], receive: Any, send: Any) -> None:
        exc = RuntimeError("downstream gave up")
        attach_reply(exc, Reply(0, True, "overloaded"))
        note_failure(exc)  # and answers on its own, not with an error
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"fallback"})

    async def call(app: Any, budget: int) -> Reply:
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: Any) -> None:
            sent.append(message)

        value = format_question(new_key(), "edge", True, budget, 10.0)
        await app({"type": "http", "method": "GET", "path": "/", "query_string": b"",
                   "headers": [(QUESTION_HEADER.encode(), value.encode())]}, receive, send)
        reply = parse_reply(dict(sent[0]["headers"])[REPLY_HEADER.encode()].decode())
        assert isinstance(reply, Reply)
        return reply

    _, _, app = _stack()
    assert asyncio.run(call(app, 2)) == Reply(2, joins=True)
    assert asyncio.run(call(app, 0)) == Reply(0, joins=True)
    fallback = AskonceASGIMiddleware(JoinASGIMiddleware(noted), layer="target")
    assert asyncio.run(call(fallback, 2)) == Reply(0, True, "overloaded", joins=True)
