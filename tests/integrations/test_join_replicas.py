"""Two replicas of a callee (real uvicorn processes) behind one real Redis answer a question once.

The handler counts its runs per question in Redis, across processes; see ``join_replicas.py``.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

import askonce
from askonce.core.wire import QUESTION_HEADER, format_question
from askonce.integrations.asgi import AskonceASGIMiddleware
from askonce.integrations.asgi_join import JoinASGIMiddleware
from askonce.propagation import new_key
from askonce.stores.join_redis import RedisJoinStore
from e2e_services import uvicorn_running
from join_replicas import Replica, replicas
from redis_server import RedisServer
from stats_delta import delta

JOINED = "askonce-joined"


def _header(key: str, deadline: float = 20.0) -> dict[str, str]:
    return {QUESTION_HEADER: format_question(key, "edge", True, 2, deadline)}


@pytest.fixture
def fleet(own_redis: RedisServer) -> Iterator[tuple[list[Replica], redis.Redis]]:
    counter = redis.Redis.from_url(own_redis.url)
    with replicas(own_redis.url) as two:
        yield two, counter
    counter.close()


def _runs(counter: redis.Redis, key: str) -> int:
    return int(counter.get(f"runs:{key}") or 0)


def test_a_question_arriving_at_both_replicas_at_once_runs_once_and_both_answer(
        fleet: tuple[list[Replica], redis.Redis]) -> None:
    (a, b), counter = fleet
    for _ in range(3):
        key = new_key()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(httpx.post, url + "/slow", content=b"q",
                                   headers=_header(key), timeout=20.0)
                       for url in (a.url, b.url, a.url, b.url)]
            rs = [f.result() for f in futures]
        assert [r.status_code for r in rs] == [200] * 4
        assert len({r.text for r in rs}) == 1 and rs[0].text.startswith("answer to q from ")
        # One ran it; the others waited for it, or (on a busy machine, arriving after it ended)
        # got its kept answer.
        how = sorted(r.headers.get(JOINED, "run") for r in rs)
        assert how.count("run") == 1 and set(how) <= {"run", "wait", "replay"}
        assert _runs(counter, key) == 1


def test_an_answer_is_replayed_from_the_other_replica_and_another_body_is_refused(
        fleet: tuple[list[Replica], redis.Redis]) -> None:
    (a, b), counter = fleet
    key = new_key()
    first = httpx.post(a.url + "/x", content=b"pay 10", headers=_header(key), timeout=20.0)
    again = httpx.post(b.url + "/x", content=b"pay 10", headers=_header(key), timeout=20.0)
    other = httpx.post(b.url + "/x", content=b"pay 1000", headers=_header(key), timeout=20.0)
    assert first.status_code == again.status_code == 200 and again.text == first.text
    assert again.headers[JOINED] == "replay" and "askonce-reply" in again.headers
    assert other.status_code == 422
    assert _runs(counter, key) == 1


def test_killing_the_replica_that_holds_the_question_lets_the_other_take_it_over(
        fleet: tuple[list[Replica], redis.Redis]) -> None:
    (a, b), counter = fleet
    key = new_key()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        lost = pool.submit(httpx.post, a.url + "/hang", content=b"q", headers=_header(key),
                           timeout=30.0)
        deadline = time.monotonic() + 20
        while _runs(counter, key) == 0 and time.monotonic() < deadline:
            time.sleep(0.02)  # until a's run has started (and holds the lease)
        assert _runs(counter, key) == 1
        waiting = pool.submit(httpx.post, b.url + "/hang", content=b"q", headers=_header(key),
                              timeout=30.0)
        time.sleep(0.2)  # b is waiting on a's run
        a.kill()
        answer = waiting.result(timeout=30)
        with pytest.raises(httpx.HTTPError):
            lost.result(timeout=30)
    assert answer.status_code == 200 and answer.text.startswith("answer to q from ")
    assert JOINED not in answer.headers  # b ran it itself, after a's lease expired
    assert _runs(counter, key) == 2
    replay = httpx.post(b.url + "/hang", content=b"q", headers=_header(key), timeout=20.0)
    assert replay.headers[JOINED] == "replay" and _runs(counter, key) == 2


def test_with_redis_down_an_asgi_replica_runs_unjoined_and_counts_it(
        own_redis: RedisServer) -> None:
    runs: list[str] = []

    async def handler(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        runs.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    store = RedisJoinStore(own_redis.url, retry_after=60.0)
    app = AskonceASGIMiddleware(JoinASGIMiddleware(handler, store=store), layer="callee")
    own_redis.stop()
    key, before = new_key(), askonce.stats()
    with uvicorn_running(app) as url:
        rs = [httpx.post(url + "/x", content=b"q", headers=_header(key), timeout=20.0)
              for _ in range(2)]
    assert [r.status_code for r in rs] == [200, 200] and len(runs) == 2
    moved = delta(before)
    assert moved["server.join.bypass"] == 2 and moved["server.join.redis.error.connection"] == 1
