"""JoinWSGIMiddleware with a RedisJoinStore: two real waitress servers, each with its own
middleware and store (replicas sharing nothing but a real Redis), answer a question once; with
Redis down, requests run unjoined and it is counted."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

import httpx

import askonce
from askonce.core.join import JoinPolicy
from askonce.core.wire import QUESTION_HEADER, format_question
from askonce.integrations.wsgi import AskonceWSGIMiddleware
from askonce.integrations.wsgi_join import JoinWSGIMiddleware
from askonce.propagation import new_key
from askonce.stores.join_redis import RedisJoinStore
from e2e_services import waitress_running
from redis_server import RedisServer
from stats_delta import delta

JOINED = "askonce-joined"


class Work:
    def __init__(self) -> None:
        self.runs: Counter[str] = Counter()
        self.lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
        q = askonce.current()
        with self.lock:
            self.runs[q.key if q is not None else "-"] += 1
        time.sleep(0.5 if environ["PATH_INFO"] == "/slow" else 0.0)
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"made " + body]


def _replica(work: Work, url: str, **store: Any) -> Any:
    join = JoinWSGIMiddleware(work, policy=JoinPolicy(ttl=60.0),
                              store=RedisJoinStore(url, **store))
    return AskonceWSGIMiddleware(join, layer="callee")


def _header(key: str) -> dict[str, str]:
    return {QUESTION_HEADER: format_question(key, "edge", True, 2, 20.0)}


def test_two_wsgi_replicas_behind_one_redis_run_a_question_once(shared_redis: RedisServer) -> None:
    work, key = Work(), new_key()
    with waitress_running(_replica(work, shared_redis.url)) as a, \
            waitress_running(_replica(work, shared_redis.url)) as b, \
            concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(httpx.post, url + "/slow", content=b"q", headers=_header(key),
                               timeout=20.0) for url in (a, b, a, b)]
        rs = [f.result() for f in futures]
        late = httpx.post(b + "/slow", content=b"q", headers=_header(key), timeout=20.0)
    assert [r.status_code for r in rs] == [200] * 4 and {r.text for r in rs} == {"made q"}
    assert sorted(r.headers.get(JOINED, "run") for r in rs) == ["run", "wait", "wait", "wait"]
    assert late.headers[JOINED] == "replay" and work.runs[key] == 1


def test_redis_down_runs_every_request_unjoined_and_counts_it(own_redis: RedisServer) -> None:
    work, key = Work(), new_key()
    app = _replica(work, own_redis.url, retry_after=60.0)
    own_redis.stop()
    before = askonce.stats()
    with waitress_running(app) as url:
        rs = [httpx.post(url + "/x", content=b"q", headers=_header(key), timeout=20.0)
              for _ in range(3)]
    assert [r.status_code for r in rs] == [200] * 3 and work.runs[key] == 3
    moved = delta(before)
    assert moved["server.join.bypass"] == 3
    assert moved["server.join.redis.error.connection"] == 1 and moved["server.join.redis.down"] == 2
