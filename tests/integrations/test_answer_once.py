"""Answering once across real hops: a question's work runs once however often it arrives.

* an nginx hop in front of a joining target retries on its own (``proxy_next_upstream``): the
  handler runs once per question while the target's ledger counts every arrival, the proxy's
  undeclared retries included;
* a POST with a counted side effect behind two retrying askonce layers, the target taking longer
  than every layer's attempt timeout on a question's first arrival: each question is answered and
  its side effect happens exactly once.

Every server is real (uvicorn, nginx) on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import shutil
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import askonce
from askonce.client import ClientPolicy
from askonce.core.ledger import Ledger, LedgerPolicy
from askonce.integrations.asgi import AskonceASGIMiddleware
from askonce.integrations.asgi_join import JoinASGIMiddleware
from askonce.integrations.httpx import AskonceTransport, AsyncAskonceTransport
from e2e_services import uvicorn_running


class Effects:
    """The target's side effect, counted per question key; a question's first run is slow when a
    hash of its key says so (``share``)."""

    def __init__(self, slow: float, share: float) -> None:
        self.slow, self.share = slow, share
        self.done: Counter[str] = Counter()
        self.lock = threading.Lock()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        while (await receive()).get("more_body", False):
            pass
        q = askonce.current()
        key = q.key if q is not None else "-"
        with self.lock:
            self.done[key] += 1  # the side effect, committed before the answer
            first = self.done[key] == 1
        draw = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "big") / 2**32
        if first and draw < self.share:
            await asyncio.sleep(self.slow)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})


def _target(effects: Effects) -> tuple[Any, Ledger]:
    ledger = Ledger(LedgerPolicy(max_exact_keys=100_000))
    return AskonceASGIMiddleware(JoinASGIMiddleware(effects), layer="target", ledger=ledger), ledger


# --- nginx retrying below the client ------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def nginx_in_front_of(upstream: str, tmp: Path) -> Iterator[str]:
    """nginx on a free port proxying to ``upstream`` (listed twice, so that a timed-out try goes
    on to the "next" server: the same one), read timeout 0.3 s, up to 3 tries."""
    binary = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(binary).exists():
        pytest.skip("nginx is not installed (scripts/test.sh installs it)")
    port = _free_port()
    host = upstream.removeprefix("http://")
    (tmp / "logs").mkdir()
    conf = tmp / "nginx.conf"
    conf.write_text(f"""
daemon off;
master_process off;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 256; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    upstream target {{
        server {host} max_fails=0;
        server {host} max_fails=0;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://target;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_read_timeout 300ms;
            proxy_next_upstream error timeout;
            proxy_next_upstream_tries 3;
        }}
    }}
}}
""")
    proc = subprocess.Popen([binary, "-p", str(tmp), "-c", str(conf)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        limit = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                break
            if proc.poll() is not None or time.monotonic() > limit:
                err = proc.stderr.read().decode() if proc.stderr else ""
                raise RuntimeError(f"nginx did not start: {err}")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def test_a_proxys_own_retries_join_the_run_and_the_ledger_counts_them(tmp_path: Path) -> None:
    effects = Effects(slow=0.5, share=1.0)  # every question's first run outlasts nginx's 0.3 s
    app, ledger = _target(effects)
    policy = ClientPolicy(layer="edge", originator=True, bucket=None, rejoin=False)
    questions = 20
    with uvicorn_running(app) as url, nginx_in_front_of(url, tmp_path) as proxy, \
            httpx.Client(transport=AskonceTransport(httpx.HTTPTransport(), policy=policy),
                         timeout=5.0) as http, concurrent.futures.ThreadPoolExecutor(10) as pool:
        statuses = list(pool.map(lambda _: http.get(proxy + "/orders").status_code,
                                 range(questions)))
    assert statuses == [200] * questions
    assert len(effects.done) == questions and set(effects.done.values()) == {1}  # ran once each
    (op,) = ledger.report(now=time.time()).operations
    assert op.distinct_keys == questions
    assert op.arrivals >= 2 * questions  # nginx tried each question again after 0.3 s
    assert op.undeclared_retries == op.arrivals - questions  # ... and the ledger saw it happen


# --- a POST behind two retrying layers ----------------------------------------------------------

ATTEMPT_TIMEOUT = 0.25


def _layer(name: str, downstream: str) -> Any:
    """A middle layer: POSTs what it is asked to ``downstream`` with the askonce client (each try
    limited to ``ATTEMPT_TIMEOUT``), joining repeated arrivals of a question itself."""
    policy = ClientPolicy(layer=name, bucket=None, attempt_timeout=ATTEMPT_TIMEOUT)
    client = httpx.AsyncClient(transport=AsyncAskonceTransport(
        httpx.AsyncHTTPTransport(), policy=policy), timeout=5.0)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        try:
            response = await client.post(downstream + "/orders", content=body)
            status, out = response.status_code, response.content
        except (httpx.HTTPError, askonce.AskonceError):
            status, out = 503, b"failed"
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
        http.post(a_url + "/orders", content=b"warm")  # the layers learn that their callees join
        effects.done.clear()
        answers = list(pool.map(
            lambda i: http.post(a_url + "/orders", content=f"order {i}".encode()),
            range(questions)))
    failed = Counter(f"{r.status_code} {r.headers.get('askonce-reply')}" for r in answers
                     if r.status_code != 200)
    assert not failed, failed
    assert len(effects.done) == questions and set(effects.done.values()) == {1}
    for op in ledger.report(now=time.time()).operations:
        assert op.per_key.max is not None and op.per_key.max <= 1 + budget
