"""Pure ASGI middleware: the question bound for each request, ``askonce-reply`` on every response.

::

    app.add_middleware(AskonceASGIMiddleware, layer="api")          # FastAPI / Starlette
    app = AskonceASGIMiddleware(app, layer="api")                     # any ASGI app

Per HTTP request (other scope types pass through untouched) it does what :mod:`._server` decides
(extract or mint, ledger, shedding, the reply, 503 for a give-up) and two things only ASGI allows:

* **deadline**: a handler still running when the propagated deadline passes, before its response has
  started, is cancelled and answered 503 with ``dnr`` reason ``deadline``;
* **disconnect**: when the client goes away before the response is complete, the handler is
  cancelled (uvicorn itself never does: the work would be wasted). A request still running after
  ``WATCH_AFTER`` seconds gets a watcher task that reads ``receive`` for the app, through a
  one-message buffer, so it sees ``http.disconnect`` while the app works; quicker requests never pay
  for the task. With ``Expect: 100-continue`` the watcher waits until the app has read once, so the
  app still decides whether the body is sent.

Cancellation is ``Task.cancel`` on the request's own task, balanced with ``uncancel`` so that a
cancellation from the server (shutdown) is never swallowed. A synchronous endpoint that the framework
runs in a thread pool cannot be stopped: its caller gets the 503 at the deadline, the thread runs on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from askonce import context
from askonce.core.wire import Limits
from askonce.integrations._server import (
    LEDGER_LOCK,
    UNMATCHED,
    Answer,
    Arrival,
    LedgerLike,
    Server,
    ServerOptions,
    note_failure,
    path_template,
)

__all__ = ["LEDGER_LOCK", "AskonceASGIMiddleware", "note_failure"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_QUESTION = b"askonce-question"
_REPLY = b"askonce-reply"
_MAX_DEPTH = 8  # mounts and wrapping middlewares followed when looking for the route table
WATCH_AFTER = 0.05  # seconds before a running request's disconnect watcher starts


class AskonceASGIMiddleware:
    """Bind the incoming question for each HTTP request and answer for it; see the module docstring.

    ``layer``: this service's name (origin of the keys it mints). ``originator``: mint edge keys when
    none arrives (else local keys). ``limits``: clamp incoming budgets and deadlines. ``budget`` and
    ``deadline``: for minted questions. ``ledger``: record every arrival (refusing over its cap with
    429). ``principal(scope) -> str``: the tenant keys are scoped to. ``operation(scope) -> str``: the
    ledger's operation name (default: method and route template, e.g. ``"GET /items/{item_id}"``).
    ``shed_deadline``: refuse arrivals past their deadline and cancel handlers at it.
    ``cancel_on_disconnect``: cancel the handler when the client goes away.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        layer: str,
        originator: bool = False,
        limits: Limits = Limits(),
        budget: int = 2,
        deadline: float | None = 30.0,
        ledger: LedgerLike | None = None,
        principal: Callable[[Scope], str] | None = None,
        operation: Callable[[Scope], str] | None = None,
        shed_deadline: bool = True,
        cancel_on_disconnect: bool = True,
    ) -> None:
        if not callable(app):
            raise ValueError(f"app must be an ASGI application, got {app!r}")
        if not isinstance(cancel_on_disconnect, bool):
            raise ValueError(f"cancel_on_disconnect must be True or False, got {cancel_on_disconnect!r}")
        self.app = app
        self.server = Server(ServerOptions(
            layer=layer, originator=originator, limits=limits, budget=budget, deadline=deadline, ledger=ledger,
            principal=principal, operation=operation, shed_deadline=shed_deadline,
        ))  # fmt: skip
        self.cancel_on_disconnect = cancel_on_disconnect

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        values = [v for k, v in scope.get("headers", ()) if k == _QUESTION]
        with self.server.arrive(values, scope, self.route) as arrival:
            if arrival.answer is not None:
                await _send_answer(send, arrival.answer)
                return
            await _Exchange(self, arrival, receive, send).run(scope)

    def route(self, scope: Scope) -> str:
        """The default operation name: the method and the route template the app will match."""
        method = str(scope.get("method", "GET"))
        routes = _routes_of(scope.get("app")) or _routes_of(self.app)
        if routes is None:
            return path_template(method, str(scope.get("path", "")))
        return f"{method} {_match(routes, scope, '', 0) or UNMATCHED}"


class _Exchange:
    """One request while the app runs: the wrapped send and receive, and the cancellation."""

    __slots__ = ("arrival", "completed", "deferred", "gone", "mw", "only_ours", "pump", "queue", "reading",
                 "reason", "receive_", "replaced", "running", "send_", "started", "task", "timer",
                 "watcher")  # fmt: skip

    def __init__(self, mw: AskonceASGIMiddleware, arrival: Arrival, receive: Receive, send: Send) -> None:
        self.mw = mw
        self.arrival = arrival
        self.receive_ = receive
        self.send_ = send
        self.started = self.completed = self.running = self.gone = self.only_ours = False
        self.reading = self.deferred = False
        self.reason: str | None = None
        self.replaced: Answer | None = None
        self.task: asyncio.Task[Any] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.watcher: asyncio.TimerHandle | None = None
        self.pump: asyncio.Task[None] | None = None
        self.queue: asyncio.Queue[Message] | None = None

    async def run(self, scope: Scope) -> None:
        mw, arrival = self.mw, self.arrival
        self.task = asyncio.current_task()
        receive = self.receive_
        if self.task is not None:
            loop = asyncio.get_running_loop()
            if mw.server.options.shed_deadline and arrival.deadline is not None:
                delay = max(0.0, arrival.deadline - context.monotonic())
                self.timer = loop.call_later(delay, self.cancel, "deadline")
            if mw.cancel_on_disconnect:
                receive = self.app_receive
                if _expects_continue(scope):
                    self.deferred = True  # the watcher is armed after the app's first read
                else:
                    self.watcher = loop.call_later(WATCH_AFTER, self.watch)
        self.running = True
        try:
            await mw.app(scope, receive, self.send)
        except asyncio.CancelledError:
            if not self.finish():
                raise
            context.count(f"server.cancelled.{self.reason}")
            if self.reason == "deadline" and not self.started:
                await _send_answer(self.send_, mw.server.deadline_answer(arrival))
            return  # after a disconnect there is nobody to answer
        except Exception as exc:
            self.finish()
            answer = mw.server.failure(arrival, exc)
            if answer is None or self.started:
                raise
            await _send_answer(self.send_, answer)
            return
        except BaseException:
            self.finish()
            raise
        if self.finish() and self.reason == "deadline" and not self.started:
            # the app swallowed the cancellation and returned without answering: answer for it
            await _send_answer(self.send_, mw.server.deadline_answer(arrival))

    def finish(self) -> bool:
        """Stop watching; True if the only cancellation the task received was ours."""
        if self.running:
            self.running = False
            if self.timer is not None:
                self.timer.cancel()
            if self.watcher is not None:
                self.watcher.cancel()
            if self.pump is not None:
                self.pump.cancel()
            if self.reason is not None and self.task is not None:
                self.only_ours = self.task.uncancel() == 0
        return self.only_ours

    def cancel(self, reason: str) -> None:
        if not self.running or self.reason is not None or self.completed or self.task is None:
            return
        if reason == "deadline" and self.started:
            return  # too late to answer 503; the response already on its way is let finish
        self.reason = reason
        self.task.cancel()

    # --- send: the reply header, and a noted failure's 503 in place of the framework's 500 -------------

    async def send(self, message: Message) -> None:
        if self.replaced is not None:
            return  # the app's own error response was replaced: drop the rest of it
        kind = message["type"]
        if kind == "http.response.start":
            arrival = self.arrival
            if arrival.noted is not None and int(message.get("status", 200)) >= 500:
                answer = self.mw.server.failure(arrival, arrival.noted)
                if answer is not None:
                    self.replaced = answer
                    self.started = self.completed = True
                    await _send_answer(self.send_, answer)
                    return
            self.started = True
            headers = list(message.get("headers") or ())
            if not any(k.lower() == _REPLY for k, _ in headers):
                headers.append((_REPLY, arrival.reply_header().encode("ascii")))
                message = {**message, "headers": headers}
        elif (kind == "http.response.body" and not message.get("more_body", False)) or kind == "http.response.pathsend":
            self.completed = True
        await self.send_(message)

    # --- receive: once the request has run a while, read ahead by one message to see a disconnect -------

    def watch(self) -> None:
        self.watcher = None
        if not self.running or self.completed or self.pump is not None:
            return
        if self.reading:  # the app is in receive() itself and will hear of a disconnect first-hand
            self.watcher = asyncio.get_running_loop().call_later(WATCH_AFTER, self.watch)
            return
        self.queue = asyncio.Queue(maxsize=1)
        self.pump = asyncio.get_running_loop().create_task(self._pump(self.queue))

    async def _pump(self, queue: asyncio.Queue[Message]) -> None:
        try:
            while True:
                message = await self.receive_()
                if message.get("type") == "http.disconnect":
                    self.gone = True
                    self.cancel("disconnect")
                    await queue.put(message)
                    return
                await queue.put(message)
        except Exception:  # the server's receive failed: to the app this is a disconnect
            self.gone = True
            if not queue.full():
                queue.put_nowait({"type": "http.disconnect"})

    async def app_receive(self) -> Message:
        queue = self.queue
        if queue is None:  # no watcher yet: straight through
            self.reading = True
            try:
                message = await self.receive_()
            finally:
                self.reading = False
            if self.deferred:
                self.deferred = False
                if self.running:
                    self.watcher = asyncio.get_running_loop().call_later(WATCH_AFTER, self.watch)
            return message
        if self.gone and queue.empty():
            return {"type": "http.disconnect"}
        return await queue.get()


async def _send_answer(send: Send, answer: Answer) -> None:
    headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in answer.headers()]
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": answer.body})


def _expects_continue(scope: Scope) -> bool:
    return any(k == b"expect" and v.lower() == b"100-continue" for k, v in scope.get("headers", ()))


# --- the route template, read from a Starlette-style route table without importing Starlette ---------


def _routes_of(app: Any) -> list[Any] | None:
    for _ in range(_MAX_DEPTH):  # through wrapping middlewares (``.app``) to a router (``.routes``)
        if app is None:
            return None
        routes = getattr(getattr(app, "router", app), "routes", None)
        if isinstance(routes, list):
            return routes
        app = getattr(app, "app", None)
    return None


def _match(routes: list[Any], scope: Scope, prefix: str, depth: int) -> str | None:
    """The template of the route that would serve ``scope``; a method mismatch counts if nothing else does."""
    partial = None
    for route in routes:
        path = getattr(route, "path", None)
        matches = getattr(route, "matches", None)
        if not isinstance(path, str) or matches is None:
            continue
        try:
            match, child = matches(scope)
        except Exception:  # a route that cannot judge this request does not serve it
            continue
        kind = getattr(match, "name", "NONE")
        if kind == "NONE":
            continue
        template = prefix + path
        inner = getattr(route, "routes", None)
        if isinstance(inner, list):  # a mount: the template continues inside it
            found = _match(inner, {**scope, **child}, template, depth + 1) if inner and depth < _MAX_DEPTH else None
            template = found or template + "/{path:path}"
        if kind == "FULL":
            return template
        partial = partial or template
    return partial
