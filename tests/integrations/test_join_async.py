"""Async mode at a joining ASGI callee on a real uvicorn server: ``Prefer: respond-async`` is
answered 202 with a status location, the run finishes in the background, and the answer is
fetched (long-polled) there, by its own principal only."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import httpx

import askonce
from askonce.core.wire import QUESTION_HEADER, format_question, parse_reply
from askonce.integrations.asgi import AskonceASGIMiddleware
from askonce.integrations.asgi_join import JoinASGIMiddleware
from askonce.propagation import new_key
from e2e_services import uvicorn_running

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


def _app(handler: Slow, **options: Any) -> Any:
    def user(scope: dict[str, Any]) -> str:
        return dict(scope["headers"]).get(b"x-user", b"").decode()

    return AskonceASGIMiddleware(JoinASGIMiddleware(handler, principal=user, **options),
                                 layer="target")


def _ask(key: str, user: str = "alice", **extra: str) -> dict[str, str]:
    return {QUESTION_HEADER: format_question(key, "edge", True, 2, 30.0), "x-user": user,
            **extra}


def test_respond_async_is_accepted_and_the_answer_is_long_polled_at_its_location() -> None:
    handler, key = Slow(1.0), new_key()
    with uvicorn_running(_app(handler)) as url, httpx.Client(base_url=url, timeout=20.0) as c:
        accepted = c.post("/orders", content=b"one", headers=_ask(key, prefer="respond-async"))
        assert accepted.status_code == 202
        # The run in the background spends the budget: none of it comes back with the 202.
        reply = parse_reply(accepted.headers["askonce-reply"])
        assert not isinstance(reply, Exception) and reply.budget == 0 and reply.joins
        assert accepted.headers["preference-applied"] == "respond-async"
        where = accepted.headers["location"]
        assert where.startswith("/.askonce/answers/") and accepted.headers["retry-after"] == "1"
        again = c.post("/orders", content=b"one", headers=_ask(key, prefer="respond-async"))
        assert again.status_code == 202 and again.headers["location"] == where  # joined
        running = c.get(where, headers={"x-user": "alice"})
        assert running.status_code == 202 and running.headers["location"] == where
        assert c.get(where, headers={"x-user": "mallory"}).status_code == 404
        done = c.get(where, headers={"x-user": "alice", "prefer": "wait=20"})
        assert done.status_code == 201 and done.text == "made one"
        assert done.headers[JOINED] == "replay"
        late = c.post("/orders", content=b"one", headers=_ask(key, prefer="respond-async"))
        assert late.status_code == 201 and late.headers[JOINED] == "replay"  # answered at once
        assert "preference-applied" not in late.headers
        assert c.get(where, headers={"x-user": "mallory"}).status_code == 404
    assert handler.runs[key] == 1


def test_past_max_background_the_preference_is_ignored_and_the_question_runs_inline() -> None:
    handler, key = Slow(0.1), new_key()
    with uvicorn_running(_app(handler, max_background=0)) as url:
        r = httpx.post(url + "/orders", content=b"x", headers=_ask(key, prefer="respond-async"),
                       timeout=20.0)
    assert r.status_code == 201 and "preference-applied" not in r.headers
    assert handler.runs[key] == 1


def test_a_background_run_is_bounded_by_the_question_deadline() -> None:
    handler, key = Slow(30.0), new_key()
    header = format_question(key, "edge", True, 2, 0.5)  # half a second left
    with uvicorn_running(_app(handler)) as url, httpx.Client(base_url=url, timeout=20.0) as c:
        accepted = c.post("/x", headers={QUESTION_HEADER: header, "prefer": "respond-async"})
        assert accepted.status_code == 202
        gone = c.get(accepted.headers["location"], headers={"prefer": "wait=10"})
    assert gone.status_code == 404  # cancelled at the deadline: no answer to keep
    assert handler.runs[key] == 1


def test_status_locations_that_name_nothing_are_404() -> None:
    with uvicorn_running(_app(Slow(0.0))) as url, httpx.Client(base_url=url, timeout=20.0) as c:
        for path in ("/.askonce/answers/", "/.askonce/answers/%%%", "/.askonce/answers/" + "A" * 5000,
                     "/.askonce/answers/R0VUIC94AGtleQ"):  # well formed, never asked
            assert c.get(path).status_code == 404
        assert c.delete("/.askonce/answers/R0VUIC94AGtleQ").status_code == 404
