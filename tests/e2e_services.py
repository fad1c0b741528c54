"""The end-to-end stack of ``integrations/test_e2e_stack.py``: four real servers on 127.0.0.1, each in a thread.

::

    edge (httpx, 1 try) -> api: FastAPI/uvicorn --requests--> svc: Flask/waitress --gRPC--> rpc: grpc.aio
                                                                                   --httpx async--> target

Every middle hop tries 3 times. The stack runs in one of two modes:

* ``askonce``: the server middlewares/interceptors and the askonce clients (``bucket=None``: all the
  servers share this process's default store, so per-target buckets would be shared too, and the bound
  must come from the traveling budget alone). The edge mints the question.
* ``naive``: no askonce anywhere; urllib3 ``Retry(total=2)`` on 503, gRPC's own ``retryPolicy``
  (``maxAttempts: 3``), a plain 3-try loop around httpx.

In both modes each hop forwards the edge's ``x-request-id`` so the target can count arrivals per question.
The target answers 503 on ``/outage``, and on ``/flaky`` fails an arrival when a hash of (seed, request id,
arrival number) falls below 10 %: independent failures that do not depend on thread scheduling.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import flask
import grpc
import httpx
import requests
import uvicorn
import waitress
from fastapi import FastAPI, Request, Response
from grpc import aio
from urllib3.util.retry import Retry

import askonce
from askonce import Backoff, RetryPolicy
from askonce.client import ClientPolicy
from askonce.core.ledger import Ledger, LedgerPolicy
from askonce.integrations.asgi import AskonceASGIMiddleware
from askonce.integrations.grpc import AskonceClientInterceptor, AsyncAskonceServerInterceptor, channel_options
from askonce.integrations.httpx import AskonceTransport, AsyncAskonceTransport
from askonce.integrations.requests import session
from askonce.integrations.wsgi import AskonceWSGIMiddleware

ATTEMPTS = 3
TIMEOUT = 5.0
RELAY = "/askonce.e2e.Relay/Call"
BACKOFF = Backoff(base=0.002, cap=0.01)  # real jittered waits, short enough for thousands of questions
FLAKY = 0.10
GRPC_RETRY = json.dumps({"methodConfig": [{"name": [{"service": "askonce.e2e.Relay"}], "retryPolicy": {
    "maxAttempts": ATTEMPTS, "initialBackoff": "0.002s", "maxBackoff": "0.01s", "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE"]}}]})


def client_policy(layer: str, attempts: int = ATTEMPTS) -> ClientPolicy:
    # Every try is counted here, so nothing sheds: no bucket, no adaptive admission (which cuts a
    # dead target off after 20 attempts; tests/client/test_admission_shells.py).
    return ClientPolicy(layer=layer, retry=RetryPolicy(attempts=attempts, backoff=BACKOFF),
                        bucket=None, admission=None)


def unlucky(seed: int, rid: str, n: int) -> bool:
    digest = hashlib.blake2b(f"{seed}:{rid}:{n}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") < FLAKY * 2**64


# --- the target ---------------------------------------------------------------------------------------


@dataclass
class Arrival:
    rid: str
    key: str | None  # the askonce question key as the target saw it
    path: tuple[str, ...]
    failed: bool


@dataclass
class Target:
    """A bare ASGI app: counts arrivals per request id, fails per scenario."""

    seed: int = 7
    arrivals: list[Arrival] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        rid = dict(scope["headers"]).get(b"x-request-id", b"").decode()
        q = askonce.current()
        with self.lock:
            self.counts[rid] += 1
            n = self.counts[rid]
        failed = scope["path"] == "/outage" or (scope["path"] == "/flaky" and unlucky(self.seed, rid, n))
        with self.lock:
            self.arrivals.append(Arrival(rid, None if q is None else q.key,
                                         () if q is None else tuple(map(str, q.path)), failed))
        await send({"type": "http.response.start", "status": 503 if failed else 200,
                    "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"no" if failed else b"ok"})


# --- the three middle services --------------------------------------------------------------------------


def api_app(svc_url: str, use_askonce: bool) -> Any:
    """FastAPI; calls svc with requests."""
    if use_askonce:
        http = session(client_policy("api"))
    else:
        http = requests.Session()
        retry = Retry(total=ATTEMPTS - 1, status_forcelist=[503], backoff_factor=0, raise_on_status=False)
        http.mount("http://", requests.adapters.HTTPAdapter(max_retries=retry))
    app = FastAPI()

    @app.get("/{scenario}")
    def relay(scenario: str, request: Request) -> Response:  # sync: FastAPI runs it in a worker thread
        rid = request.headers.get("x-request-id", "")
        r = http.get(f"{svc_url}/{scenario}", headers={"x-request-id": rid}, timeout=TIMEOUT)
        return Response(r.content, status_code=200 if r.status_code == 200 else 503)

    if use_askonce:
        app.add_middleware(AskonceASGIMiddleware, layer="api")
    return app


def svc_app(rpc_target: str, use_askonce: bool) -> Any:
    """Flask; calls rpc with a sync gRPC stub."""
    if use_askonce:
        channel = grpc.intercept_channel(
            grpc.insecure_channel(rpc_target, options=channel_options()),
            AskonceClientInterceptor(client_policy("svc"), target=rpc_target, idempotent=True))
    else:
        channel = grpc.insecure_channel(rpc_target, options=[("grpc.service_config", GRPC_RETRY)])
    relay_call = channel.unary_unary(RELAY)
    app = flask.Flask("svc")

    @app.get("/<scenario>")
    def relay(scenario: str) -> Any:
        rid = flask.request.headers.get("x-request-id", "")
        try:
            relay_call(f"{scenario} {rid}".encode(), timeout=TIMEOUT, metadata=(("x-request-id", rid),))
        except grpc.RpcError:
            return "the rpc service failed", 503
        return "ok"

    if use_askonce:
        app.wsgi_app = AskonceWSGIMiddleware(app.wsgi_app, layer="svc")  # type: ignore[method-assign]
    app.extensions["askonce.channel"] = channel
    return app


class Rpc:
    """A grpc.aio server in a thread of its own; calls the target with an async httpx client."""

    def __init__(self, target_url: str, use_askonce: bool) -> None:
        self.target_url = target_url
        self.use_askonce = use_askonce
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self) -> int:
        if self.use_askonce:
            self.http = httpx.AsyncClient(transport=AsyncAskonceTransport(policy=client_policy("rpc")),
                                          timeout=TIMEOUT)
            self.server = aio.server(interceptors=[AsyncAskonceServerInterceptor(layer="rpc")])
        else:
            self.http = httpx.AsyncClient(timeout=TIMEOUT)
            self.server = aio.server()
        handler = grpc.unary_unary_rpc_method_handler(self.relay)
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "askonce.e2e.Relay", {"Call": handler}),))
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return port

    async def relay(self, request: bytes, ctx: Any) -> bytes:
        scenario, rid = request.decode().split(" ", 1)
        url, headers = f"{self.target_url}/{scenario}", {"x-request-id": rid}
        tries = 1 if self.use_askonce else ATTEMPTS  # with askonce the transport retries
        for _ in range(tries):
            r = await self.http.get(url, headers=headers)
            if r.status_code == 200:
                return b"ok"
        await ctx.abort(grpc.StatusCode.UNAVAILABLE, "the target failed")
        raise AssertionError("unreachable")

    def close(self) -> None:
        async def stop() -> None:
            await self.server.stop(None)
            await self.http.aclose()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


# --- running it ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def uvicorn_running(app: Any) -> Iterator[str]:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="off", log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    limit = time.monotonic() + 10
    while not server.started:
        if not thread.is_alive() or time.monotonic() > limit:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)


@contextlib.contextmanager
def waitress_running(app: Any) -> Iterator[str]:
    server = waitress.create_server(app, host="127.0.0.1", port=0, threads=16, asyncore_loop_timeout=0.05)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.effective_port}"
    finally:
        # Close every socket from the loop's own thread: closed under a select() running elsewhere, one
        # fails it with EBADF. With its map empty the loop returns.
        # OSError: the loop already ended and closed its trigger; nothing is left to close under it.
        with contextlib.suppress(OSError):
            server.trigger.pull_trigger(lambda: [d.close() for d in list(server._map.values())])
        thread.join(10)
        server.task_dispatcher.shutdown()


@dataclass
class Stack:
    url: str
    target: Target
    ledger: Ledger | None
    use_askonce: bool


@contextlib.contextmanager
def stack(use_askonce: bool, seed: int = 7) -> Iterator[Stack]:
    """The four services, innermost first; torn down in reverse order."""
    target = Target(seed)
    ledger = Ledger(LedgerPolicy(window=86_400.0, max_exact_keys=100_000)) if use_askonce else None
    target_app: Any = AskonceASGIMiddleware(target, layer="target", ledger=ledger) if use_askonce else target
    with uvicorn_running(target_app) as target_url:
        rpc = Rpc(target_url, use_askonce)
        try:
            svc = svc_app(f"127.0.0.1:{rpc.port}", use_askonce)
            try:
                with waitress_running(svc) as svc_url, uvicorn_running(api_app(svc_url, use_askonce)) as api_url:
                    yield Stack(api_url, target, ledger, use_askonce)
            finally:
                svc.extensions["askonce.channel"].close()
        finally:
            rpc.close()


@dataclass
class Answer:
    key: str
    status: int
    reply: askonce.Reply | None


class Edge:
    """The originator: mints each question (askonce mode) and asks once, with no retries of its own."""

    def __init__(self, s: Stack) -> None:
        self.stack = s
        transport = AskonceTransport(policy=client_policy("edge", attempts=1)) if s.use_askonce else None
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        self.client = httpx.Client(transport=transport, timeout=TIMEOUT * 2, limits=limits)

    def ask(self, scenario: str, key: str, budget: int) -> Answer:
        url, headers = f"{self.stack.url}/{scenario}", {"x-request-id": key}
        if not self.stack.use_askonce:
            return Answer(key, self.client.get(url, headers=headers).status_code, None)
        with askonce.question(budget=budget, deadline=20.0, key=key):
            r = self.client.get(url, headers=headers)
        return Answer(key, r.status_code, askonce.propagation.extract_reply(r.headers))

    def close(self) -> None:
        self.client.close()
