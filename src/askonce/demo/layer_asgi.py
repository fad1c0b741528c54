"""The gateway and the service: FastAPI under uvicorn, calling the next layer with httpx (async).

``python -m askonce.demo.layer_asgi --name gateway`` (or ``service``). ``GET /q`` calls the next
layer's ``GET /q``: in naive mode through the plain retry loop, forwarding ``x-question-id``; in
askonce mode through :class:`~askonce.integrations.httpx.AsyncAskonceTransport` under
:class:`~askonce.integrations.asgi.AskonceASGIMiddleware`. ``POST /_demo/config`` switches the
mode and settings (and drops every client, bucket and breaker), ``GET /_demo/stats`` tells the
requests in flight, ``GET /_demo/health`` answers when the process is ready.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import MutableMapping
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response

import askonce
from askonce.client import ClientPolicy, HedgePolicy
from askonce.core.backoff import Backoff
from askonce.core.retry import RetryPolicy
from askonce.demo import child, naive
from askonce.demo.params import DEMO_BREAKER, LayerSettings, from_json
from askonce.errors import reply_of
from askonce.integrations.asgi import AskonceASGIMiddleware
from askonce.integrations.asgi_join import JoinASGIMiddleware
from askonce.integrations.httpx import AsyncAskonceTransport

POOLS = 16  # one httpx pool stalls under hundreds of idle connections (httpcore's quadratic scan)
LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=64)
# Plain HTTP on loopback: verify=False only skips loading CA certificates (costly per client).

Scope = MutableMapping[str, Any]


class Layer:
    """One middle layer's state: its settings, its clients, and the requests in flight."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.settings = LayerSettings()
        self.clients: list[httpx.AsyncClient] = []
        self.turn = 0
        self.inflight = 0
        self.rng = random.Random(1)
        self.naive_app = self._app()
        self.askonce_app = self._askonce(join=True)

    def _app(self) -> FastAPI:
        app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

        @app.get("/q")
        async def q(request: Request) -> Response:
            return await self.handle(request)

        return app

    def _askonce(self, join: bool) -> AskonceASGIMiddleware:
        """The app under askonce: a fresh join table each run (one run's answers are not the
        next run's)."""
        inner: Any = JoinASGIMiddleware(self.naive_app) if join else self.naive_app
        return AskonceASGIMiddleware(inner, layer=self.name)

    async def configure(self, settings: LayerSettings) -> None:
        old, self.clients = self.clients, []
        self.settings = settings
        self.rng = random.Random(f"{settings.seed}:{self.name}")
        if settings.mode == "askonce":
            self.askonce_app = self._askonce(settings.join)
        store: Any = None
        if settings.mode == "askonce" and settings.redis is not None:
            from askonce.stores.aredis import AsyncRedisStore

            store = AsyncRedisStore(settings.redis, prefix=f"{settings.prefix}:{self.name}")
        elif settings.mode == "askonce":
            from askonce import _stats
            from askonce.stores.memory import MemoryStore

            store = MemoryStore(_stats.monotonic)  # fresh buckets and breakers for every run
        policy = ClientPolicy(
            layer=self.name,
            retry=RetryPolicy(attempts=settings.attempts,
                              backoff=Backoff(base=settings.backoff_base,
                                              cap=max(settings.backoff_cap,
                                                      settings.backoff_base))),
            attempt_timeout=settings.timeout, deadline_grace=settings.grace,
            breaker=DEMO_BREAKER if settings.breaker else None,
            hedge=HedgePolicy() if settings.hedge else None,
            respond_async=settings.respond_async,
        )  # fmt: skip
        for _ in range(POOLS):
            if settings.mode == "askonce":
                transport: httpx.AsyncBaseTransport = AsyncAskonceTransport(
                    httpx.AsyncHTTPTransport(limits=LIMITS, verify=False), policy=policy,
                    store=store)
            else:
                transport = httpx.AsyncHTTPTransport(limits=LIMITS, verify=False)
            # askonce: each try is limited by the policy's attempt_timeout (not toward a callee
            # that joins: this layer then waits for it) and the question's deadline.
            timeout = None if settings.mode == "askonce" else settings.timeout
            self.clients.append(httpx.AsyncClient(transport=transport, timeout=timeout,
                                                  trust_env=False))
        for client in old:
            await client.aclose()

    def client(self) -> httpx.AsyncClient:
        self.turn = (self.turn + 1) % len(self.clients)
        return self.clients[self.turn]

    async def handle(self, request: Request) -> Response:
        s = self.settings
        url = s.downstream + "/q"
        self.inflight += 1
        try:
            if s.mode == "naive":
                headers = {"x-question-id": request.headers.get("x-question-id", "")}
                status = await naive.get_async(self.client(), url, headers, attempts=s.attempts,
                                               timeout=s.timeout, base=s.backoff_base,
                                               cap=s.backoff_cap, rng=self.rng)
                return Response(b"ok\n" if status == 200 else b"failed\n", status_code=status)
            try:
                response = await self.client().get(url)
            except Exception as exc:
                if reply_of(exc) is None:
                    raise
                # A give-up the client recorded (askonce.client.last_reply): the middleware passes
                # its do-not-retry on in the reply to this error answer.
                return Response(b"failed\n", status_code=503)
            if response.status_code >= 500:  # a returned give-up was recorded too (last_reply)
                return Response(b"failed\n", status_code=response.status_code)
            return Response(b"ok\n", status_code=response.status_code)
        finally:
            self.inflight -= 1

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/_demo/"):
            await self.control(scope, receive, send)
        elif scope["type"] == "http":
            app = self.askonce_app if self.settings.mode == "askonce" else self.naive_app
            await app(scope, receive, send)

    async def control(self, scope: Scope, receive: Any, send: Any) -> None:
        path = scope["path"]
        status, body = 200, {"ok": True}  # type: tuple[int, dict[str, Any]]
        if path == "/_demo/config":
            try:
                await self.configure(from_json(LayerSettings, json.loads(await read_body(receive))))
            except (ValueError, TypeError) as exc:
                status, body = 400, {"error": str(exc)}
        elif path == "/_demo/stats":
            body = {"inflight": self.inflight, "mode": self.settings.mode,
                    "counters": askonce.stats()}
        elif path != "/_demo/health":
            status, body = 404, {"error": "no such control"}
        await send_json(send, status, body)


async def read_body(receive: Any) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def send_json(send: Any, status: int, body: object) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--name", required=True, choices=("gateway", "service"))
    args = parser.parse_args()
    child.prepare()
    child.serve_asgi(Layer(args.name))


if __name__ == "__main__":
    main()
