"""The target: Starlette under uvicorn with a fixed worker pool, counting every arrival per
question.

``python -m askonce.demo.target``. ``GET /q`` waits for one of ``slots`` workers (FIFO), holds it
for the service time (``asyncio.sleep``: the work occupies a worker, not the CPU) and answers 200,
unless the failure mode says otherwise (see :class:`~askonce.demo.params.TargetSettings`). Every
arrival is counted before anything else, per question id: the ``x-question-id`` header in naive
mode, the askonce key in askonce mode, where
:class:`~askonce.integrations.asgi.AskonceASGIMiddleware` also feeds the real ledger (coverage) and
sheds and cancels work past its deadline, and, where the settings ask for it (the overload),
keeps an adaptive concurrency limit, refusing what is over it 503 ``r=overloaded``. Like any
uvicorn app in naive mode, a request whose caller has gone is worked on to the end. Each piece of
work is logged (question id, when it ended, how long), so the runner can tell which work answered
a question and which was wasted.

In askonce mode the status location of async mode (``Prefer: respond-async``,
``integrations.asgi_join.STATUS_PATH``) goes to the askonce app too; a poll is not an arrival.

Control: ``POST /_demo/config`` (settings; resets every count), ``POST /_demo/drain`` (answer every
queued and new request 500, which no layer retries, so the stack unwinds between runs),
``GET /_demo/stats``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import time
from collections.abc import Iterator, MutableMapping
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import askonce
from askonce.core.concurrency import ConcurrencyPolicy
from askonce.core.ledger import LedgerPolicy
from askonce.demo import child
from askonce.demo.params import TargetSettings, capacity_factor, draw, from_json
from askonce.integrations.asgi import AskonceASGIMiddleware
from askonce.integrations.asgi_join import STATUS_PATH, JoinASGIMiddleware

BIN = 0.1  # seconds per bin of the arrivals timeline
MAX_LOG = 500_000  # work items logged per run; beyond, work is only summed
Scope = MutableMapping[str, Any]
_QUESTION = b"askonce-question"
_ID = b"x-question-id"


class Drained(Exception):
    """The run is over: a queued request is answered at once instead of waiting for a worker."""


class Pool:
    """``slots`` workers handed out in arrival order; a cancelled waiter simply leaves the queue."""

    def __init__(self, slots: int) -> None:
        self.free = slots
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    async def acquire(self) -> None:
        if self.free > 0:
            self.free -= 1
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self.release()  # a worker was handed over just as we were cancelled: pass it on
            raise

    def release(self) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.free += 1

    def queued(self) -> int:
        return sum(1 for w in self.waiters if not w.done())

    def drain(self) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_exception(Drained())


class Target:
    def __init__(self) -> None:
        self.control = Starlette(routes=[
            Route("/_demo/health", self.health),
            Route("/_demo/config", self.configure, methods=["POST"]),
            Route("/_demo/drain", self.drain, methods=["POST"]), Route("/_demo/stats", self.stats),
        ])  # fmt: skip
        self.settings = TargetSettings()
        self.ledger: Any = None
        self.askonce_app: Any = None
        self.reset()

    def reset(self) -> None:
        s = self.settings
        self.pool = Pool(s.slots)
        self.per_key: collections.Counter[str] = collections.Counter()
        self.timeline: collections.Counter[int] = collections.Counter()
        self.arrivals = self.unkeyed = self.inflight = 0
        self.done: list[tuple[str | None, float, float]] = []
        self.running: dict[object, tuple[str | None, float]] = {}
        self.unlogged = 0.0
        self.draining = False
        old, self.ledger = self.ledger, None
        if old is not None and hasattr(old, "close"):
            old.close()
        if s.mode == "askonce":
            policy = LedgerPolicy(window=600.0, max_exact_keys=200_000)
            if s.redis is not None:
                from askonce.ledger.store import RedisLedger

                self.ledger = RedisLedger(s.redis, prefix=s.prefix, policy=policy,
                                          flush_interval=0.1)
            else:
                from askonce.ledger.store import MemoryLedger

                self.ledger = MemoryLedger(policy)
            work: Any = JoinASGIMiddleware(self.work_app) if s.join else self.work_app
            self.askonce_app = AskonceASGIMiddleware(
                work, layer="target", ledger=self.ledger,
                concurrency=ConcurrencyPolicy() if s.concurrency else None)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["path"].startswith(STATUS_PATH) and self.settings.mode == "askonce":
            await self.askonce_app(scope, receive, send)  # async mode's status polls: no arrivals
            return
        if scope["path"] != "/q":
            await self.control(scope, receive, send)
            return
        key = self.count(scope)
        scope["askonce_demo.arrival"] = (key, self.per_key[key] if key is not None else 0)
        if self.settings.mode == "askonce":
            await self.askonce_app(scope, receive, send)
        else:
            await self.work_app(scope, receive, send)

    def count(self, scope: Scope) -> str | None:
        """Count one arrival under its question id; the id as the counting saw it."""
        self.arrivals += 1
        self.timeline[int((time.time() - self.settings.t0) / BIN)] += 1
        key: str | None = None
        wanted = _QUESTION if self.settings.mode == "askonce" else _ID
        for name, value in scope.get("headers", ()):
            if name == wanted:
                text = value.decode("latin-1")
                if wanted == _ID:
                    key = text or None
                else:
                    q = askonce.propagation.extract({"askonce-question": text})
                    key = None if q is None else q.key
                break
        if key is None:
            self.unkeyed += 1
        else:
            self.per_key[key] += 1
        return key

    async def work_app(self, scope: Scope, receive: Any, send: Any) -> None:
        s = self.settings
        key, n = scope.get("askonce_demo.arrival", (None, 0))
        if self.draining:  # 500, which no layer retries: the stack unwinds at once
            await answer(send, 500, b"drained\n")
            return
        if s.failure == "outage" or (
                s.failure == "transient" and draw(s.seed, "fail", key or "", n) < s.rate):
            await answer(send, 503, b"target failed\n")
            return
        slow = s.failure == "slow" and draw(s.seed, "slow", key or "", n) < s.slow_share
        self.inflight += 1
        try:
            try:
                await self.pool.acquire()
            except Drained:
                await answer(send, 500, b"drained\n")
                return
            seconds = ((s.slow_time if slow else s.service_time)
                       / capacity_factor(s.capacity, self.now()))
            with self.working(key):
                await asyncio.sleep(seconds)
            await answer(send, 200, b"ok\n")
        finally:
            self.inflight -= 1

    def now(self) -> float:
        return time.time() - self.settings.t0

    @contextlib.contextmanager
    def working(self, key: str | None) -> Iterator[None]:
        """Hold a worker for the block and log the work: (question id, seconds into the run at the
        end, length).

        Work cut short (the askonce middleware cancels at the deadline and on disconnect) is logged
        too.
        """
        started = self.now()
        token = object()
        self.running[token] = (key, started)
        try:
            yield
        finally:
            del self.running[token]
            self.pool.release()
            end = self.now()
            if len(self.done) < MAX_LOG:
                self.done.append((key, end, end - started))
            else:
                self.unlogged += end - started

    async def health(self, request: Request) -> Response:
        return JSONResponse({"ok": True})

    async def configure(self, request: Request) -> Response:
        try:
            settings = from_json(TargetSettings, json.loads(await request.body()))
        except (ValueError, TypeError) as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        self.pool.drain()
        self.settings = settings
        self.reset()
        return JSONResponse({"ok": True})

    async def drain(self, request: Request) -> Response:
        self.draining = True
        self.pool.drain()
        return JSONResponse({"ok": True})

    async def stats(self, request: Request) -> Response:
        now = self.now()
        work = [*self.done, *((key, now, now - started) for key, started in self.running.values())]
        body: dict[str, Any] = {
            "arrivals": self.arrivals, "unkeyed": self.unkeyed, "inflight": self.inflight,
            "queued": self.pool.queued(), "work_s": sum(w[2] for w in work) + self.unlogged,
        }  # fmt: skip
        if request.query_params.get("full"):
            body["work"] = work  # the work still running counts up to now
            body["per_key"] = dict(self.per_key)
            body["timeline"] = {str(k): v for k, v in sorted(self.timeline.items())}
            body["bin"] = BIN
            body["ledger"] = self.ledger_summary()
        return JSONResponse(body)

    def ledger_summary(self) -> dict[str, Any] | None:
        if self.ledger is None:
            return None
        if hasattr(self.ledger, "flush"):
            self.ledger.flush()
        report = self.ledger.report(time.time())
        totals = report.totals()
        ops = [o for o in report.operations if o.operation == "GET /q"]
        return {
            "arrivals": totals.arrivals, "attributable": totals.attributable,
            "distinct_keys": totals.distinct_keys, "amplification": totals.amplification,
            "coverage": totals.coverage, "retries_by": dict(totals.retries_by),
            "p99": max((o.per_key.p99 or 0 for o in ops), default=None),
            "max": max((o.per_key.max or 0 for o in ops), default=None),
            "undeclared_retries": totals.undeclared_retries, "approximate": totals.approximate,
        }  # fmt: skip


async def answer(send: Any, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def main() -> None:
    child.prepare()
    child.serve_asgi(Target())


if __name__ == "__main__":
    main()
