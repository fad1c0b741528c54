"""The whole stack on 127.0.0.1 with real servers (see ``e2e_services.py``):

    edge (httpx, 1 try) -> FastAPI/uvicorn -requests-> Flask/waitress -gRPC-> grpc.aio -httpx async-> target

Each middle hop tries 3 times. The servers run as threads of this process, so askonce's per-process
state (the default store of buckets) is shared by all of them: the clients run with ``bucket=None``, and
every bound below comes from the traveling budget alone. The questions are minted with deterministic
keys, and the target's failures are a hash of (seed, key, arrival number), so a run does not depend on
thread scheduling.

Budget 3, not the default 2: with 10 % independent failures the innermost hop alone succeeds with
probability 1 - 0.1^3 = 99.9 %, exactly the bar, so 2,000 questions would fail the bar a third of the
time; one more retry for the question (taken by the next hop up, as the paths show) makes it 99.99 %.

``ASKONCE_E2E_QUESTIONS`` changes the number of questions of the transient run (default 2,000).
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import flask
import httpx
import pytest
from fastapi import FastAPI, Response

import askonce
from askonce import Reply
from askonce.core.question import mint_key
from askonce.core.wire import QUESTION_HEADER
from askonce.integrations.asgi import LEDGER_LOCK, AskonceASGIMiddleware
from askonce.integrations.httpx import AskonceTransport
from askonce.integrations.wsgi import AskonceWSGIMiddleware
from e2e_services import ATTEMPTS, Answer, Edge, Stack, Target, client_policy, stack, uvicorn_running, waitress_running

BUDGET = 3
WORKERS = 8
QUESTIONS = int(os.environ.get("ASKONCE_E2E_QUESTIONS", "2000"))


def keys(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [mint_key(1_700_000_000_000 + i, rng.randbytes(16)) for i in range(n)]


def run(s: Stack, scenario: str, n: int, seed: int) -> list[Answer]:
    edge = Edge(s)
    try:
        with ThreadPoolExecutor(WORKERS) as pool:
            return list(pool.map(lambda k: edge.ask(scenario, k, BUDGET), keys(n, seed)))
    finally:
        edge.close()


def arrivals(s: Stack, answers: list[Answer]) -> list[int]:
    with s.target.lock:
        counts = Counter(a.rid for a in s.target.arrivals)
    return [counts[a.key] for a in answers]


@pytest.fixture(scope="module")
def with_askonce() -> Iterator[Stack]:
    with stack(use_askonce=True) as s:
        yield s


@pytest.fixture(scope="module")
def naive() -> Iterator[Stack]:
    with stack(use_askonce=False) as s:
        yield s


def test_an_outage_is_retried_by_the_layer_nearest_it_only(with_askonce: Stack) -> None:
    answers = run(with_askonce, "outage", 40, seed=1)
    # rpc, nearest the target, tries its 3 times and says so (retried): nobody above retries,
    # although the question has a retry of its budget left (one_layer).
    assert ATTEMPTS < 1 + BUDGET and arrivals(with_askonce, answers) == [ATTEMPTS] * 40
    left = BUDGET - (ATTEMPTS - 1)
    assert {(a.status, a.reply) for a in answers} == {(503, Reply(left, True, "retried"))}

    # The key seen at the target is the one minted at the top, on every arrival...
    seen = [a for a in with_askonce.target.arrivals if a.rid in {x.key for x in answers}]
    assert all(a.key == a.rid for a in seen)
    # ...and the attempt path says which hop retried: rpc, twice.
    paths = Counter(a.path for a in seen)
    prefix = ("edge:1", "api:1")
    assert paths == {(*prefix, "svc:1", "rpc:1"): 40, (*prefix, "svc:1", "rpc:2"): 40,
                     (*prefix, "svc:1", "rpc:3"): 40}
    # The target's own ledger counts the same.
    assert with_askonce.ledger is not None
    with LEDGER_LOCK:
        report = with_askonce.ledger.report(time.time()).find("GET /outage")
    assert report is not None and report.amplification == ATTEMPTS and report.per_key.max == ATTEMPTS
    assert dict(report.retries_by) == {"rpc": 80} and report.coverage == 1.0


def test_outage_without_askonce_multiplies_to_27(naive: Stack) -> None:
    answers = run(naive, "outage", 8, seed=2)
    assert arrivals(naive, answers) == [27] * 8
    assert {a.status for a in answers} == {503}


def test_transient_failures_almost_all_succeed_at_little_extra_load(with_askonce: Stack) -> None:
    started = time.monotonic()
    answers = run(with_askonce, "flaky", QUESTIONS, seed=3)
    elapsed = time.monotonic() - started
    a = arrivals(with_askonce, answers)
    ok = sum(x.status == 200 for x in answers)
    print(f"\ntransient 10 %: {QUESTIONS} questions in {elapsed:.1f} s, success {ok / QUESTIONS:.2%}, "
          f"arrivals per question mean {statistics.mean(a):.3f}, max {max(a)}")
    assert ok >= 0.999 * QUESTIONS
    assert max(a) <= 1 + BUDGET
    assert statistics.mean(a) < 1.2  # every retry is a real one: 1 + 0.1 + 0.01 + ... ~ 1.11
    assert all(x.reply is not None and not x.reply.dnr for x in answers if x.status == 200)


# --- a handler that answers 5xx after a call it made gave up --------------------------------------------


@pytest.fixture(scope="module")
def down() -> Iterator[str]:
    with uvicorn_running(Target()) as url:
        yield url + "/outage"


def give_up_then(status: int, target: str) -> int:
    """Call a target that is down until askonce gives up, then answer ``status`` regardless."""
    with httpx.Client(transport=AskonceTransport(policy=client_policy("app")), timeout=5.0) as http:
        assert http.get(target).status_code == 503
    return status


def asgi_app(target: str) -> object:
    app = FastAPI()

    @app.get("/answer/{status}")
    def answer(status: int) -> Response:
        return Response(b"mine", status_code=give_up_then(status, target))

    app.add_middleware(AskonceASGIMiddleware, layer="mid")
    return app


def wsgi_app(target: str) -> object:
    app = flask.Flask("mid")

    @app.get("/answer/<int:status>")
    def answer(status: int) -> tuple[str, int]:
        return "mine", give_up_then(status, target)

    app.wsgi_app = AskonceWSGIMiddleware(app.wsgi_app, layer="mid")  # type: ignore[method-assign]
    return app


@pytest.mark.parametrize("kind", ["asgi", "wsgi"])
@pytest.mark.parametrize(("status", "answered", "dnr"), [(502, 503, True), (503, 503, True), (500, 503, True),
                                                         (200, 200, False), (404, 404, False)])
def test_a_5xx_after_a_downstream_give_up_passes_the_do_not_retry_on(kind: str, status: int, answered: int,
                                                                     dnr: bool, down: str) -> None:
    running = uvicorn_running(asgi_app(down)) if kind == "asgi" else waitress_running(wsgi_app(down))
    value = askonce.core.wire.format_question(askonce.propagation.new_key(), "edge", True, 2, 5.0)
    with running as url:
        r = httpx.get(f"{url}/answer/{status}", headers={QUESTION_HEADER: value}, timeout=10)
    reply = askonce.propagation.extract_reply(r.headers)
    assert r.status_code == answered and reply is not None
    # The app's 5xx is answered as a give-up: the caller learns the question's budget is spent.
    assert reply == (Reply(0, True, "exhausted") if dnr else Reply(0))
