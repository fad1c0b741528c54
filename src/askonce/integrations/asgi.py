"""Pure ASGI middleware: the question bound for each request, ``askonce-reply`` on every response.

::

    app.add_middleware(AskonceASGIMiddleware, layer="api")          # FastAPI / Starlette
    app = AskonceASGIMiddleware(app, layer="api")                     # any ASGI app

Per HTTP request (other scope types pass through untouched) it does what :mod:`._server` decides
(extract or mint, ledger, shedding, the reply, 503 for a give-up) and two things only ASGI allows:

* **deadline**: a handler still running when the propagated deadline passes, before its response has
  started, is cancelled and answered 503 with ``dnr`` reason ``deadline``;
* **disconnect**: when the client goes away before the response is complete, the handler is
  cancelled (uvicorn itself never does: the work would be wasted).

A caller that sends a deadline stops listening at it: the askonce clients send each attempt's own
limit (an attempt's timeout, capped by the question's time), so a caller that gives up on an
attempt does so at the deadline this layer enforces anyway. So a request is watched for a
disconnect only when nothing says when its caller stops listening: it has no propagated deadline
(none arrived, it was minted here, or ``shed_deadline=False``), or this layer joins (``asgi_join``:
toward a joining callee the clients send the question's whole time, longer than they wait) and the
request is not a run that others may join (which a disconnect never cancels). Such a request, once
it has run ``WATCH_AFTER`` seconds, is watched; quicker requests never pay for it. Under uvicorn
(its h11 and httptools request cycles, whose ``receive`` says ``http.disconnect`` once the cycle's
``disconnected`` flag is set) the sweep below reads that flag, at most every ``POLL_EVERY``
seconds, while the server still reads the socket (the body fully received, reading not paused):
no task. Otherwise (another server, a body still coming, a receive wrapped by an outer
middleware) a watcher task reads ``receive`` for the app, through a one-message buffer, so it sees
``http.disconnect`` while the app works. With ``Expect: 100-continue`` the watch waits until the
app has read once, so the app still decides whether the body is sent. A caller with a deadline
that goes away earlier for another reason leaves its handler running until that deadline at most.

Neither needs a timer per request: the running requests of an event loop are visited by one timer
(``_Sweep``). A request joins the loop's current batch (a list append); the batch is taken in
``SWEEP_EVERY`` seconds after it opened, and only its requests still running then get anything
more: those with a deadline a place in a heap ordered by deadline (a deadline due before that
visit goes into the heap at once), the timer set for the earliest, so the deadline is kept to the
same instant as with a timer per request; those to be watched a place in a queue visited
``WATCH_AFTER`` later (``WATCH_AFTER`` to ``WATCH_AFTER + SWEEP_EVERY`` seconds after each
started). A request that ends empties its entries (and leaves the batch if it is its last), which
are dropped when they come first (or when empty entries outnumber the others). When the loop's
last running request ends, the sweep drops what it holds and cancels its timer, so that an idle
server is not woken for nothing (at most once per ``SWEEP_EVERY``: a busy loop keeps its timer). A
request quicker than ``SWEEP_EVERY`` costs an append and a pop; the cost of a slow one does not
grow with its latency, apart from the flag read at each visit.

Cancellation is ``Task.cancel`` on the request's own task, balanced with ``uncancel`` so that a
cancellation from the server (shutdown) is never swallowed. A synchronous endpoint that the
framework runs in a thread pool cannot be stopped: its caller gets the 503 at the deadline, the
thread runs on.
"""

from __future__ import annotations

import asyncio
import contextvars
import heapq
import itertools
import math
import sys
import threading
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

from askonce import _stats
from askonce.core.concurrency import ConcurrencyPolicy
from askonce.core.naming import method_name, path_template
from askonce.core.wire import Limits
from askonce.integrations._server import (
    LEDGER_LOCK,
    METHODS,
    UNMATCHED,
    Answer,
    Arrival,
    LedgerLike,
    Secret,
    Server,
    ServerOptions,
    note_failure,
)

__all__ = ["LEDGER_LOCK", "AskonceASGIMiddleware", "ConcurrencyPolicy", "note_failure",
           "route_operations"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_QUESTION = b"askonce-question"
_REPLY = b"askonce-reply"
_REPLY_LEN = len(_REPLY)
_EXPECT = b"expect"
_MAX_DEPTH = 8  # mounts and wrapping middlewares followed when looking for the route table
WATCH_AFTER = 0.05  # seconds before a running request's disconnect watcher starts
SWEEP_EVERY = 0.01  # the most often the running requests of one event loop are visited
POLL_EVERY = 0.05  # the most often a server's disconnect flag is read for a watched request


class AskonceASGIMiddleware:
    """Bind the incoming question for each HTTP request and answer for it; see the module docstring.

    ``layer``: this service's name (origin of the keys it mints). ``originator``: mint edge keys
    when none arrives (else local keys). ``limits``: clamp incoming budgets and deadlines.
    ``budget`` and ``deadline``: for minted questions. ``ledger``: record every arrival (refusing
    over its cap with 429). ``principal(scope) -> str``: the tenant keys are scoped to.
    ``operation(scope) -> str``: the ledger's operation name (default: method and route template,
    e.g. ``"GET /items/{item_id}"``). ``shed_deadline``: refuse arrivals past their deadline and
    cancel handlers at it. ``cancel_on_disconnect``: cancel the handler when the client goes away.
    ``edge_secret``: the originators' secret (or several, newest first): with a ledger, an edge key
    whose signature does not verify is recorded as not attributable (origin ``"~unsigned"``); an
    originator signs what it mints. ``trust``: whether an arriving question is believed as sent
    (default: yes, unless ``originator``; see ``ServerOptions``). ``concurrency``: an adaptive limit
    on the requests in the app (``ConcurrencyPolicy``; off by default); over it, 503 at once with
    ``dnr`` reason ``overloaded`` and ``Retry-After``.
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
        edge_secret: Secret | Sequence[Secret] | None = None,
        trust: bool | Callable[[Any], bool] | None = None,
        concurrency: ConcurrencyPolicy | None = None,
    ) -> None:
        if not callable(app):
            raise ValueError(f"app must be an ASGI application, got {app!r}")
        if not isinstance(cancel_on_disconnect, bool):
            raise ValueError("cancel_on_disconnect must be True or False, "
                             f"got {cancel_on_disconnect!r}")
        self.app = app
        self.server = Server(ServerOptions(
            layer=layer, originator=originator, limits=limits, budget=budget, deadline=deadline,
            ledger=ledger, principal=principal, operation=operation, shed_deadline=shed_deadline,
            edge_secret=edge_secret, trust=trust, concurrency=concurrency,
        ))  # fmt: skip
        self.cancel_on_disconnect = cancel_on_disconnect
        self._shed = shed_deadline
        self._timed = shed_deadline or cancel_on_disconnect
        self._route = self.route  # bound once: every request passes it
        # (loop ref, its sweep)
        self._sweep: tuple[Callable[[], object], _Sweep | None] = (lambda: None, None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        values: list[bytes] = []
        expect = False
        for k, v in scope.get("headers", ()):
            if k == _QUESTION:
                values.append(v)
            elif k == _EXPECT and v.lower() == b"100-continue":
                expect = True
        server = self.server
        arrival = server.open(values, scope, self._route)
        ex = None
        try:
            if arrival.answer is not None:
                await _send_answer(send, arrival.answer)
                return
            ex = _Exchange(self, arrival, receive, send)
            if self._timed:
                receive = ex.start(expect)
            ex.running = True
            try:
                await self.app(scope, receive, ex.send)
            except asyncio.CancelledError:
                if not ex.finish():
                    raise
                _stats.count(f"server.cancelled.{ex.reason}")
                if ex.reason == "deadline" and not ex.started:
                    await _send_answer(send, server.deadline_answer(arrival))
                return  # after a disconnect there is nobody to answer
            except Exception as exc:
                ex.finish()
                # Started: too late for a 503.
                answer = None if ex.started else server.failure(arrival, exc)
                if answer is None:
                    raise
                await _send_answer(send, answer)
                return
            except BaseException:
                ex.finish()
                raise
            if ex.finish() and ex.reason == "deadline" and not ex.started:
                # the app swallowed the cancellation and returned without answering: answer for it
                await _send_answer(send, server.deadline_answer(arrival))
        finally:
            if arrival.slot is not None:  # a slot of the concurrency limit: the latency sample
                server.done(arrival, ex is not None and ex.went_well())
            server.close(arrival)

    def sweep(self, loop: asyncio.AbstractEventLoop) -> _Sweep:
        """The running requests of ``loop``: one queue per loop, shared by every middleware."""
        ref, sweep = self._sweep
        if ref() is not loop or sweep is None:
            sweep = _sweep_of(loop)
            # One assignment: threads with loops of their own may race.
            self._sweep = (weakref.ref(loop), sweep)
        return sweep

    def route(self, scope: Scope) -> str:
        """The default operation name: the method and the route template the app will match."""
        method = method_name(str(scope.get("method", "GET")))
        routes = _routes_of(scope.get("app")) or _routes_of(self.app)
        if routes is None:
            return path_template(method, str(scope.get("path", "")))
        return f"{method} {_match(routes, scope, '', 0) or UNMATCHED}"


class _Sweep:
    """One loop's running requests, visited by one timer (module docstring).

    ``batch``: the requests started since the batch opened (``opened``, on the loop's clock), taken
    in at the visit ``SWEEP_EVERY`` later, when those still running have their deadline put in the
    heap and a place in ``due`` to be watched; a request that ends while it is the batch's last
    leaves it at once. ``by``: when the batch is visited, on askonce's clock: a deadline before it
    goes into the heap at once. A heap entry is ``[when, seq, exchange]``, ``when`` on the loop's
    clock (where a timer of the request's own would have been set); a request that ends sets its
    exchange to ``None``. ``live``: the running requests with a deadline. ``due``: batches of
    requests to visit after ``WATCH_AFTER``, in order. ``polled``: requests whose server's own
    disconnect flag is read at every visit, at most every ``POLL_EVERY`` seconds. ``running``: the
    requests started and not finished; the last one to end rests the sweep (:meth:`rest`), at most
    once before ``rested``. The sweep holds no handle of the loop (its timer only weakly), so that a
    loop stopped with requests still queued (a test's) can be collected, and with it this entry of
    ``_sweeps``.
    """

    __slots__ = ("at", "batch", "by", "context", "deadlines", "due", "limit", "live", "opened",
                 "poll_at", "polled", "rested", "running", "seq", "timer")

    def __init__(self) -> None:
        self.batch: list[_Exchange] = []
        self.opened = math.inf  # inf: no batch open
        self.by = -math.inf
        self.limit = _BATCH  # the batch's length at which its ended requests are dropped
        self.deadlines: list[list[Any]] = []
        self.due: deque[tuple[float, list[_Exchange | None]]] = deque()
        self.polled: list[_Exchange] = []
        self.poll_at = math.inf
        self.live = 0
        self.running = 0  # requests started and not finished
        self.rested = -math.inf  # when it may rest again (askonce's clock)
        self.seq = itertools.count()  # ties in the heap never compare exchanges
        self.at = math.inf  # when the timer fires (``loop.time()``); inf: not armed
        self.timer: Callable[[], asyncio.TimerHandle | None] = _no_timer
        # The timer runs in a context of its own, not in that of the request that happened to arm it
        # (which it would keep alive from visit to visit); the watcher tasks it starts need none of
        # a request's variables.
        self.context = contextvars.Context()

    def enter(self, exchange: _Exchange, loop: asyncio.AbstractEventLoop) -> None:
        """Take ``exchange`` in at the next visit of the batch."""
        batch = self.batch
        batch.append(exchange)
        if self.opened == _INF:
            self.open(loop)
        elif len(batch) > self.limit:
            self.compact()

    def rest(self) -> None:
        """No request of the loop is running: what is queued is of ended ones, and the timer is
        cancelled, so that a loop with nothing else to do is not woken to find nothing here."""
        self.opened = self.at = _INF
        timer = self.timer()
        if timer is not None:
            timer.cancel()
            self.timer = _no_timer
        if self.batch:
            self.batch.clear()
        if self.deadlines:
            self.deadlines.clear()
        if self.due:
            self.due.clear()
        if self.polled:
            self.polled.clear()
            self.poll_at = _INF

    def compact(self) -> None:
        """Drop the batch's ended requests: a loop that starts requests without ever turning."""
        batch = self.batch
        batch[:] = [e for e in batch if e.running]
        self.limit = 2 * len(batch) + _BATCH

    def open(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        self.opened = now
        self.by = _stats.monotonic() + SWEEP_EVERY
        if now + SWEEP_EVERY < self.at:
            self.arm(now + SWEEP_EVERY, loop)

    def add_deadline(self, exchange: _Exchange, deadline: float,
                     loop: asyncio.AbstractEventLoop) -> list[Any]:
        """Cancel ``exchange`` at ``deadline`` unless it ends first (its entry emptied)."""
        at = loop.time() + (deadline - _stats.monotonic())  # the deadline on the loop's clock
        entry = self.push(exchange, at)
        if at < self.at:
            self.arm(at, loop)
        return entry

    def push(self, exchange: _Exchange, at: float) -> list[Any]:
        heap = self.deadlines
        entry = [at, next(self.seq), exchange]
        heapq.heappush(heap, entry)
        if len(heap) > 2 * self.live + 64:  # mostly ended requests whose deadlines are still ahead
            heap[:] = [e for e in heap if e[2] is not None]
            heapq.heapify(heap)
        return entry

    def ended(self, entry: list[Any]) -> None:
        """A request in the heap has ended: its entry is emptied, and dropped if first."""
        entry[2] = None
        heap = self.deadlines
        while heap and heap[0][2] is None:
            heapq.heappop(heap)

    def poll(self, exchange: _Exchange, loop: asyncio.AbstractEventLoop) -> None:
        """Read the server's disconnect flag of ``exchange`` at every visit from now on."""
        self.polled.append(exchange)
        if self.poll_at == math.inf:
            self.poll_at = at = loop.time() + POLL_EVERY
            if at < self.at:
                self.arm(at, loop)

    def arm(self, at: float, loop: asyncio.AbstractEventLoop) -> None:
        old = self.timer()
        if old is not None:
            old.cancel()
        self.at = at
        handle = loop.call_at(at, self.visit, loop, context=self.context)
        try:
            self.timer = weakref.ref(handle)
        except TypeError:  # a loop whose handles cannot be weakly referenced: the old one fires
            self.timer = _no_timer

    def admit(self, now: float) -> None:
        """The batch's visit: its requests still running get their deadline and their watch."""
        batch, self.batch = self.batch, []
        watch_at = max(self.opened + SWEEP_EVERY, now) + WATCH_AFTER  # each started by ``now``
        self.opened, self.by, self.limit = math.inf, -math.inf, _BATCH
        offset = now - _stats.monotonic()  # askonce's clock to the loop's
        watch: list[_Exchange | None] = []
        for exchange in batch:
            if exchange.running:
                deadline = exchange.arrival.deadline
                if exchange.timed and exchange.entry is None and deadline is not None:
                    exchange.entry = self.push(exchange, deadline + offset)
                if exchange.wants:
                    exchange.wants = False
                    exchange.place = (watch, len(watch))  # emptied if it ends first
                    watch.append(exchange)
        if watch:
            self.due.append((watch_at, watch))

    def visit(self, loop: asyncio.AbstractEventLoop) -> None:
        self.at, self.timer = math.inf, _no_timer
        heap, due, now = self.deadlines, self.due, loop.time()
        try:
            if self.opened + SWEEP_EVERY <= now:
                self.admit(now)
            while heap and heap[0][0] <= now:
                exchange = heapq.heappop(heap)[2]
                if exchange is not None:
                    exchange.entry = None
                    exchange.cancel("deadline")
            while due and due[0][0] <= now:
                for exchange in due.popleft()[1]:
                    if exchange is not None:
                        exchange.place = None
                        exchange.visited(loop)
            if self.poll_at <= now:
                polled, self.polled = self.polled, []
                self.poll_at = math.inf
                keep = self.polled
                for exchange in polled:
                    if exchange.running and not exchange.completed:
                        owner = exchange.owner
                        try:  # the usual case read here; the others in Exchange.polled
                            quiet = owner.disconnected is False and owner.flow.read_paused is False
                        except AttributeError:
                            quiet = False
                        if quiet:
                            keep.append(exchange)
                        else:
                            exchange.polled(loop)
        finally:  # whatever happened to one request, the others are still visited
            while heap and heap[0][2] is None:
                heapq.heappop(heap)
            if self.polled and self.poll_at == math.inf:
                self.poll_at = now + POLL_EVERY
            at = min(heap[0][0] if heap else math.inf, self.opened + SWEEP_EVERY, self.poll_at,
                     max(due[0][0], now + SWEEP_EVERY) if due else math.inf)
            if at < self.at:
                self.arm(at, loop)


_BATCH = 256
_INF = math.inf
_running_loop = asyncio._get_running_loop  # public as get_running_loop, which raises without one
# Python 3.11's asyncio.current_task(loop) is this dictionary's get(loop), in Python (3.12: C).
_CURRENT_TASKS: dict[asyncio.AbstractEventLoop, asyncio.Task[Any]] | None = (
    getattr(asyncio.tasks, "_current_tasks", None) if sys.version_info < (3, 12) else None)


def _no_timer() -> None:
    return None


_sweeps: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Sweep] = weakref.WeakKeyDictionary()
_sweeps_lock = threading.Lock()


def _sweep_of(loop: asyncio.AbstractEventLoop) -> _Sweep:
    with _sweeps_lock:
        sweep = _sweeps.get(loop)
        if sweep is None:
            sweep = _sweeps[loop] = _Sweep()
        return sweep


# The servers whose ``receive`` is a method of a request object with a disconnect flag: uvicorn's
# request cycles (h11 and httptools) set ``disconnected`` when the connection is lost, which they
# notice while they read the socket (the request's body fully received, reading not paused).
_POLLABLE_MODULES = frozenset({"uvicorn.protocols.http.h11_impl",
                               "uvicorn.protocols.http.httptools_impl"})
_pollable_types: dict[type, bool] = {}


def _pollable(receive: Receive) -> Any:
    """The request object whose disconnect flag says what ``receive`` would, or ``None``."""
    owner = getattr(receive, "__self__", None)
    if owner is None:
        return None
    kind = type(owner)
    known = _pollable_types.get(kind)
    if known is None:
        known = (kind.__module__ in _POLLABLE_MODULES and kind.__name__ == "RequestResponseCycle"
                 and getattr(receive, "__name__", None) == "receive")
        if len(_pollable_types) < 64:
            _pollable_types[kind] = known
    if not known:
        return None
    try:
        ready = (owner.more_body is False and type(owner.disconnected) is bool
                 and owner.flow.read_paused is False)
    except AttributeError:  # another version of the server: read through a watcher task
        return None
    return owner if ready else None


class _Exchange:
    """One request while the app runs: the wrapped send and receive, and the cancellation.

    Most of its state is a class attribute until set: a request answered at once sets few of them.
    """

    started = completed = running = gone = only_ours = False
    status = 0  # the status the app started its response with
    reading = deferred = False
    wants = False  # to be watched for a disconnect once the sweep takes it in
    reason: str | None = None
    replaced: Answer | None = None
    task: asyncio.Task[Any] | None = None
    sweep: _Sweep | None = None
    entry: list[Any] | None = None  # its entry in the sweep's heap (the deadline)
    place: tuple[list[_Exchange | None], int] | None = None  # its place in a batch of ``due``
    timed = False  # a propagated deadline cancels it
    owner: Any = None  # the server's request object whose disconnect flag the sweep reads
    pump: asyncio.Task[None] | None = None
    queue: asyncio.Queue[Message] | None = None

    def __init__(self, mw: AskonceASGIMiddleware, arrival: Arrival, receive: Receive,
                 send: Send) -> None:
        self.mw = mw
        self.arrival = arrival
        self.receive_ = receive
        self.send_ = send

    def start(self, expect: bool) -> Receive:
        """Arrange the deadline or the disconnect watch; the ``receive`` to give the app."""
        mw, receive = self.mw, self.receive_
        loop = _running_loop()
        if loop is None:
            return receive
        self.task = task = (asyncio.current_task(loop) if _CURRENT_TASKS is None
                            else _CURRENT_TASKS.get(loop))
        if task is None:
            return receive
        ref, sweep = mw._sweep
        if ref() is not loop or sweep is None:
            sweep = mw.sweep(loop)
        self.sweep = sweep
        sweep.running += 1
        batch = sweep.batch  # Sweep.enter, spelled out: every request comes here
        batch.append(self)
        if sweep.opened == _INF:
            sweep.open(loop)
        elif len(batch) > sweep.limit:
            sweep.compact()
        if mw.cancel_on_disconnect:
            receive = self.app_receive
            if expect:
                self.deferred = True  # the watcher is armed after the app's first read
            else:
                self.wants = True
        if mw._shed:
            deadline = self.arrival.deadline
            if deadline is not None:
                self.timed = True
                sweep.live += 1
                if deadline < sweep.by:  # before the batch's visit: into the heap now
                    self.entry = sweep.add_deadline(self, deadline, loop)
        return receive

    def visited(self, loop: asyncio.AbstractEventLoop) -> None:
        """The sweep came by: a running request to watch gets its disconnect watch."""
        if self.watched():
            self.watch(loop)

    def watched(self) -> bool:
        """Whether a disconnect is to be watched for: nothing says when the caller stops listening
        (module docstring)."""
        arrival = self.arrival
        return not self.timed or (arrival.joins and not arrival.detached)

    def finish(self) -> bool:
        """Stop watching; True if the only cancellation the task received was ours."""
        if self.running:
            self.running = False
            sweep = self.sweep
            if (sweep is not None and sweep.running == 1
                    and (now := _stats.monotonic()) >= sweep.rested):
                # The loop's last running request: nothing is left to visit. At most once per
                # SWEEP_EVERY: a busy loop keeps its one timer rather than set one per request.
                sweep.rested = now + SWEEP_EVERY
                sweep.running = sweep.live = 0
                sweep.rest()
            elif sweep is not None:
                sweep.running -= 1
                batch = sweep.batch
                if batch and batch[-1] is self:
                    batch.pop()
                if self.timed:
                    sweep.live -= 1
                    entry = self.entry
                    if entry is not None:
                        self.entry = None
                        sweep.ended(entry)
                place = self.place
                if place is not None:
                    self.place = None
                    place[0][place[1]] = None
            if self.pump is not None:
                self.pump.cancel()
            if self.reason is not None and self.task is not None:
                self.only_ours = self.task.uncancel() == 0
        return self.only_ours

    def went_well(self) -> bool:
        """The app answered on its own, below 500, and nobody cancelled it."""
        return self.reason is None and self.replaced is None and 0 < self.status < 500

    def cancel(self, reason: str) -> None:
        if not self.running or self.reason is not None or self.completed or self.task is None:
            return
        if reason == "deadline" and self.started:
            return  # too late to answer 503; the response already on its way is let finish
        if reason == "disconnect" and self.arrival.detached:
            return  # a run others may join (asgi_join): its caller re-attaches, or others wait
        self.reason = reason
        self.task.cancel()

    # --- send: the reply header, and a noted failure's 503 in place of the framework's 500 --------

    async def send(self, message: Message) -> None:
        if self.replaced is not None:
            return  # the app's own error response was replaced: drop the rest of it
        kind = message["type"]
        if kind == "http.response.start":
            arrival = self.arrival
            status = message.get("status", 200)
            if type(status) is not int:
                status = int(status)
            self.status = status
            if status >= 500 and arrival.noted is not None:
                answer = self.mw.server.failure(arrival, arrival.noted)
                if answer is not None:
                    self.replaced = answer
                    self.started = self.completed = True
                    await _send_answer(self.send_, answer)
                    return
            self.started = True
            headers = message.get("headers") or ()
            if type(headers) is not list and type(headers) is not tuple:
                headers = list(headers)  # an iterable that could be read only once
                message = {**message, "headers": headers}
            for k, _ in headers:
                if len(k) == _REPLY_LEN and k.lower() == _REPLY:  # other names: not lowered
                    break
            else:
                message = {**message, "headers": [*headers, (_REPLY, arrival.reply_bytes())]}
        elif ((kind == "http.response.body" and not message.get("more_body", False))
              or kind == "http.response.pathsend"):
            self.completed = True
        await self.send_(message)

    # --- receive: once the request has run a while, watch for a disconnect ----------------------

    def watch(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self.running or self.completed or self.pump is not None or self.owner is not None:
            return
        sweep = self.sweep
        assert sweep is not None
        owner = _pollable(self.receive_)
        if owner is not None:  # the server's own flag, read by the sweep: no task
            self.owner = owner
            sweep.poll(self, loop)
        elif self.reading:  # the app is in receive() and will hear of a disconnect first-hand
            self.wants = True
            sweep.enter(self, loop)
        else:
            self.pump_(loop)

    def polled(self, loop: asyncio.AbstractEventLoop) -> None:
        """The sweep read the server's disconnect flag."""
        if self.completed:
            return
        owner = self.owner
        try:
            gone, paused = owner.disconnected is True, owner.flow.read_paused is not False
        except AttributeError:
            gone, paused = False, True
        if gone and not self.reading:  # reading, the app hears of it first-hand
            self.gone = True
            self.cancel("disconnect")
        elif paused and not gone and not self.reading:  # the server no longer reads the socket
            self.owner = None
            self.pump_(loop)
        else:
            assert self.sweep is not None
            self.sweep.poll(self, loop)

    def pump_(self, loop: asyncio.AbstractEventLoop) -> None:
        """A watcher task that reads ``receive`` ahead of the app, through a one-message buffer."""
        self.queue = asyncio.Queue(maxsize=1)
        self.pump = loop.create_task(self._pump(self.queue))

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
        if queue is None:  # no watcher task: straight through
            self.reading = True
            try:
                message = await self.receive_()
            finally:
                self.reading = False
            if self.deferred:
                self.deferred = False
                if self.running:
                    assert self.sweep is not None
                    self.wants = True
                    self.sweep.enter(self, asyncio.get_running_loop())
            return message
        if self.gone and queue.empty():
            return {"type": "http.disconnect"}
        return await queue.get()


async def _send_answer(send: Send, answer: Answer) -> None:
    headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in answer.headers()]
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": answer.body})


# --- the route template, read from a Starlette-style route table without importing Starlette ------


def _routes_of(app: Any) -> list[Any] | None:
    for _ in range(_MAX_DEPTH):  # through wrapping middlewares (``.app``) to a router (``.routes``)
        if app is None:
            return None
        routes = getattr(getattr(app, "router", app), "routes", None)
        if isinstance(routes, list):
            return routes
        app = getattr(app, "app", None)
    return None


def route_operations(app: Any) -> list[str]:
    """Every operation name the default ``operation`` gives a request to ``app`` (Starlette,
    FastAPI: its route table, mounts included): each route's template with each of its methods
    (``"GET /items/{item_id}"``), a mount's ``/{path:path}``, and ``"GET ~unmatched"`` and the like.
    For an allow-list such as the Prometheus collector's ``operations=``; empty when ``app`` has no
    route table (the names then come from the path)."""
    routes = _routes_of(app)
    if routes is None:
        return []
    names = {f"{m} {UNMATCHED}" for m in METHODS}
    _templates(routes, "", 0, names)
    return sorted(names)


def _templates(routes: list[Any], prefix: str, depth: int, out: set[str]) -> None:
    for route in routes:  # as _match reads them
        path = getattr(route, "path", None)
        if not isinstance(path, str) or getattr(route, "matches", None) is None:
            continue
        template = prefix + path
        inner = getattr(route, "routes", None)
        if isinstance(inner, list):  # a mount: its routes, and what none of them serves
            out.update(f"{m} {template}/{{path:path}}" for m in METHODS)
            if inner and depth < _MAX_DEPTH:
                _templates(inner, template, depth + 1, out)
        elif hasattr(route, "methods"):  # an HTTP route (None: it takes any method)
            out.update(f"{m} {template}" for m in route.methods or METHODS)


def _match(routes: list[Any], scope: Scope, prefix: str, depth: int) -> str | None:
    """The template of the route that would serve ``scope``.

    A method mismatch counts if nothing else does.
    """
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
            found = (_match(inner, {**scope, **child}, template, depth + 1)
                     if inner and depth < _MAX_DEPTH else None)
            template = found or template + "/{path:path}"
        if kind == "FULL":
            return template
        partial = partial or template
    return partial
