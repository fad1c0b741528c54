"""What ``JoinWSGIMiddleware`` reads of a request body under a real waitress server, which sets
``wsgi.input_terminated`` on every request: a bodyless GET is joined (and answered 202 in async
mode), a chunked body is read to its end and compared, and one too large to compare runs unjoined
with the app reading all of it."""

from __future__ import annotations

from typing import Any

import httpx

import askonce
from askonce.core.wire import QUESTION_HEADER, format_question
from askonce.integrations.wsgi import AskonceWSGIMiddleware
from askonce.integrations.wsgi_join import JoinWSGIMiddleware
from askonce.propagation import new_key
from e2e_services import waitress_running
from stats_delta import delta


def _app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok\n"]


def test_a_get_under_waitress_is_joined_and_answered_202_in_async_mode() -> None:
    headers = {QUESTION_HEADER: format_question(new_key(), "edge", True, 2, 10.0),
               "prefer": "respond-async"}
    app = AskonceWSGIMiddleware(JoinWSGIMiddleware(_app), layer="api")
    before = askonce.stats()
    with waitress_running(app) as url, \
            httpx.Client(base_url=url, timeout=10.0, trust_env=False) as client:
        response = client.get("/q", headers=headers)
    assert delta(before).get("server.join.unread", 0) == 0
    assert response.status_code == 202 and "location" in response.headers


def _echo(environ: dict[str, Any], start_response: Any) -> list[bytes]:
    body = environ["wsgi.input"].read()
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [str(len(body)).encode(), b" ", body[:8]]


def _chunks(data: bytes) -> Any:
    for i in range(0, len(data), 1000):
        yield data[i:i + 1000]


def test_a_chunked_body_is_read_to_its_end_joined_and_one_too_large_reaches_the_app_whole() -> None:
    from askonce.core.join import JoinPolicy

    key = new_key()
    headers = {QUESTION_HEADER: format_question(key, "edge", True, 2, 10.0)}
    app = AskonceWSGIMiddleware(JoinWSGIMiddleware(_echo, policy=JoinPolicy(max_body=4096)),
                                layer="api")
    before = askonce.stats()
    with waitress_running(app) as url, \
            httpx.Client(base_url=url, timeout=10.0, trust_env=False) as client:
        small = b"a" * 3000
        first = client.post("/w", headers=headers, content=_chunks(small))
        again = client.post("/w", headers=headers, content=_chunks(small))
        other = client.post("/w", headers=headers, content=_chunks(b"b" * 3000))
        big = b"c" * 10_000
        large = client.post("/w", headers={QUESTION_HEADER: format_question(
            new_key(), "edge", True, 2, 10.0)}, content=_chunks(big))
    assert first.text == "3000 aaaaaaaa" and again.text == first.text
    assert again.headers.get("askonce-joined") == "replay"
    assert other.status_code == 422  # the same key with another body
    assert large.status_code == 200 and large.text == "10000 cccccccc"
    assert delta(before).get("server.join.unread", 0) == 1
