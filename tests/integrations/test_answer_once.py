"""Answering once across real hops: a question's work runs once however often it arrives:
a POST with a counted side effect behind two retrying askonce layers, the target taking longer
  than every layer's attempt timeout on a question's first arrival: each question is answered and
  its side effect happens exactly once.

Every server is real (uvicorn) on 127.0.0.1. A proxy's own retries: test_proxy_retries.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import threading
import time
from collections import Counter
from typing import Any

import httpx

import askonce
from asgi_body import read_body
from askonce.client import ClientPolicy
from askonce.core.ledger import Ledger, LedgerPolicy
from askonce.integrations.asgi import AskonceASGIMiddleware
from askonce.integrations.asgi_join import JoinASGIMiddleware
from askonce.integrations.httpx import AskonceTransport, AsyncAskonceTransport
from e2e_services import uvicorn_running
from stats_delta import delta


class Effects:
    """The target's side effect, counted per question key; a question's first run is slow when a
    hash of its key says so (``share``), except a ``warm`` one's: the warm-up that teaches the
    layers that their callees join must answer within their attempt timeout."""

    def __init__(self, slow: float, share: float) -> None:
        self.slow, self.share = slow, share
        self.done: Counter[str] = Counter()
        self.lock = threading.Lock()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = await read_body(receive)
        q = askonce.current()
        key = q.key if q is not None else "-"
        with self.lock:
            self.done[key] += 1  # the side effect, committed before the answer
            first = self.done[key] == 1
        draw = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "big") / 2**32
        if first and draw < self.share and body != b"warm":
            await asyncio.sleep(self.slow)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})


def _target(effects: Effects) -> tuple[Any, Ledger]:
    ledger = Ledger(LedgerPolicy(window=86_400.0, max_exact_keys=100_000))  # one window
    return AskonceASGIMiddleware(JoinASGIMiddleware(effects), layer="target", ledger=ledger), ledger


# --- a POST behind two retrying layers ----------------------------------------------------------

ATTEMPT_TIMEOUT = 0.25


def _layer(name: str, downstream: str) -> Any:
    """A middle layer: POSTs what it is asked to ``downstream`` with the askonce client (each try
    limited to ``ATTEMPT_TIMEOUT``), joining repeated arrivals of a question itself."""
    policy = ClientPolicy(layer=name, bucket=None, attempt_timeout=ATTEMPT_TIMEOUT)
    # httpx's own timeout as long as the question's deadline: toward a callee that joins the layer
    # waits for its answer, and a loaded machine's stall must not end the wait first.
    client = httpx.AsyncClient(transport=AsyncAskonceTransport(
        httpx.AsyncHTTPTransport(), policy=policy), timeout=30.0)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = await read_body(receive)
        try:
            response = await client.post(downstream + "/orders", content=body)
            status, out = response.status_code, response.content
        except (httpx.HTTPError, askonce.AskonceError) as exc:
            status, out = 503, f"{name}: {exc!r}"[:200].encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": out})

    return AskonceASGIMiddleware(JoinASGIMiddleware(app), layer=name)


def test_a_post_s_side_effect_happens_once_per_question_behind_two_retrying_layers() -> None:
    effects = Effects(slow=0.5, share=0.1)  # 10 % of first runs outlast both layers' attempts
    target, ledger = _target(effects)
    questions, budget = 1000, 3
    edge = ClientPolicy(layer="edge", originator=True, bucket=None, rejoin=False,
                        retry=askonce.RetryPolicy(budget=budget, deadline=30.0))
    with uvicorn_running(target) as t_url, uvicorn_running(_layer("svc", t_url)) as s_url, \
            uvicorn_running(_layer("api", s_url)) as a_url, \
            httpx.Client(transport=AskonceTransport(httpx.HTTPTransport(), policy=edge),
                         timeout=30.0) as http, concurrent.futures.ThreadPoolExecutor(16) as pool:
        # The layers learn that their callees join (a client learns it from a callee's reply).
        assert http.post(a_url + "/orders", content=b"warm").status_code == 200
        effects.done.clear()
        before = askonce.stats()
        answers = list(pool.map(
            lambda i: http.post(a_url + "/orders", content=f"order {i}".encode()),
            range(questions)))
    failed = Counter(f"{r.status_code} {r.headers.get('askonce-reply')} {r.text[:120]}"
                     for r in answers if r.status_code != 200)
    assert not failed, (failed, delta(before))  # the counters say what a layer went through
    assert len(effects.done) == questions and set(effects.done.values()) == {1}
    for op in ledger.report(now=time.time()).operations:
        assert op.per_key.max is not None and op.per_key.max <= 1 + budget
