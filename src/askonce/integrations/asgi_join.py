"""Answer once at an ASGI callee: a repeated question joins the run in flight or is replayed.

``JoinASGIMiddleware`` goes *inside* :class:`~askonce.integrations.asgi.AskonceASGIMiddleware`
(which binds the question and counts every arrival in the ledger)::

    app = AskonceASGIMiddleware(JoinASGIMiddleware(app), layer="orders", ledger=ledger)

For a question whose key arrived from a caller (not one this layer minted), the decision is
:class:`askonce.core.join.Joins`'s, per (principal, method and path, key): the first arrival runs
the handler; one that arrives while it runs waits for its answer; one that arrives after it
answered, within the policy's ``ttl``, gets that answer again; the same key with a different
request (query or body) is refused with 422. Answers sent this way carry ``askonce-joined: wait``
or ``replay``. Counted in ``askonce.stats()``: ``server.join.<run|wait|replay|conflict|bypass>``,
``server.join.unread`` for a request body too large to compare (it runs unjoined), and
``server.join.too-large`` for an answer too large to keep (its waiters run it again).

``principal``: a callable of the ASGI scope naming who asks (after your authentication); a
question's answer is never replayed to another principal. Without it every caller is one
principal: give one on a public edge.

What it cannot tell apart: two calls of one operation made on purpose inside one question (a poll
loop) look like a retry of the first, and are joined or replayed. Bind a child question per call
(``askonce.fanout(label)``) to make them distinct. An answer larger than ``max_body`` is not kept
(the body is not buffered past it), so its waiters run the handler themselves, one at a time. The
table serves one event loop: a waiter on another loop runs unjoined (``server.join.other-loop``).

``store``: a :class:`~askonce.stores.join_redis.RedisJoinStore` shares the joins of a fleet of
replicas (the same decisions, leased in Redis). Async mode: a question asked with ``Prefer:
respond-async`` is answered 202 with a status location under ``status_path`` and runs in the
background (at most ``max_background`` at once, within its deadline); a GET there answers it
(``Prefer: wait=N`` long-polls), for the same principal only, at any replica sharing the store
(:mod:`askonce.integrations._join_async`). With ``callbacks=`` (allowed URL prefixes, or a
callable of the URL and the principal) and ``callback_secret=``, a caller may add
``askonce-callback: <URL>`` and gets the answer POSTed there, signed
(:mod:`askonce.integrations.callbacks`); by default the header is ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from askonce import _stats
from askonce._context import current_frame
from askonce.core.join import Answer, Entry, JoinPolicy, Verdict
from askonce.core.question import Tab
from askonce.core.wire import is_rejoin
from askonce.integrations._join import (
    CONFLICT,
    JOINED_HEADER,
    MAX_REARRIVALS,
    REFUSED,
    Joining,
    Run,
    Step,
    announce,
    answered_by_run,
    detach,
    digest,
    joined,
    principal_of,
    ran,
    step,
    wait_left,
)
from askonce.integrations._join_async import (
    STATUS_PATH,
    accepted,
    located,
    location,
    prefer,
    status_answer,
)
from askonce.integrations.asgi import ASGIApp, Message, Receive, Scope, Send
from askonce.integrations.callbacks import CALLBACK_HEADER, Allow, Hooks, adeliver, asked

if TYPE_CHECKING:
    from askonce.core.signing import Secret
    from askonce.stores.join_redis import RedisJoinStore

__all__ = ["JOINED_HEADER", "STATUS_PATH", "JoinASGIMiddleware"]

QUESTION = b"askonce-question"


async def _refuse(send: Send) -> None:
    """A re-attach with no run to join: refused, never run (the run it is for may still be going
    elsewhere, or went to another replica; running it again could do its work twice)."""
    _stats.count("server.join.refused-rejoin")
    status, headers, body = REFUSED
    await send({"type": "http.response.start", "status": status,
                "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]})
    await send({"type": "http.response.body", "body": body})


class JoinASGIMiddleware(Joining):
    """See the module docstring. ``policy``: how long answers are kept, how many, how large."""

    app: ASGIApp

    def __init__(self, app: ASGIApp, *, policy: JoinPolicy = JoinPolicy(),
                 principal: Callable[[Scope], str] | None = None,
                 store: RedisJoinStore | None = None, status_path: str = STATUS_PATH,
                 max_background: int = 100, callbacks: Allow | None = None,
                 callback_secret: Secret | Sequence[Secret] | None = None) -> None:
        super().__init__(app, policy, principal, kind="an ASGI", request="scope")
        if store is not None and not callable(getattr(store, "aarrive", None)):
            raise ValueError(f"store must be a RedisJoinStore, got {store!r}")
        if not isinstance(status_path, str) or not status_path.startswith("/") \
                or not status_path.endswith("/"):
            raise ValueError(f"status_path must start and end with '/', got {status_path!r}")
        if not isinstance(max_background, int) or not 0 <= max_background <= 100_000:
            raise ValueError(f"max_background must be an int within 0..100000, "
                             f"got {max_background!r}")
        self.store = store
        self.status_path = status_path
        self.max_background = max_background
        self._background: set[asyncio.Task[None]] = set()
        self._hooks = Hooks.build(callbacks, callback_secret)
        self._deliveries: set[asyncio.Task[None]] = set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        frame = current_frame()
        if scope["type"] == "http" and str(scope.get("path", "")).startswith(self.status_path):
            await self._status(scope, send)
            return
        if scope["type"] != "http" or frame is None or frame[0].minted_here:
            await self.app(scope, receive, send)
            return
        rejoin = any(k == QUESTION and is_rejoin(v) for k, v in scope.get("headers", ()))
        body, receive = await _read_body(receive, self.policy.max_body)
        announce()
        who = principal_of(self.principal, scope)
        if body is None or who is None:
            _stats.count("server.join.unread" if body is None else "server.join.principal-error")
            await (_refuse(send) if rejoin else self.app(scope, receive, send))
            return
        key = (who, f"{scope.get('method', '')} {scope.get('path', '')}", frame[0].key)
        fingerprint = digest(scope.get("query_string", b""), body)
        tab = frame[0]
        later = prefer(scope).respond_async and not rejoin
        hook = _hook(self._hooks, scope, who) if later else None
        if self.store is not None:
            await self._shared(key, fingerprint, rejoin, later, hook, tab, scope, body, receive,
                               send)
            return
        loop = asyncio.get_running_loop()
        for _ in range(MAX_REARRIVALS):
            with self._lock:
                verdict, entry = self.joins.arrive(key, fingerprint, loop.time())
                if verdict is Verdict.RUN and entry is not None:
                    if rejoin:  # nothing to join: the lost run may still be going elsewhere
                        self.joins.abandon(key, entry)
                    else:
                        entry.signal = Run(loop, asyncio.Event(), tab)
            _stats.count(f"server.join.{verdict.value}")
            same = entry is None or verdict is not Verdict.WAIT or _loop_of(entry) is loop
            if not same:
                _stats.count("server.join.other-loop")  # an asyncio.Event serves one loop
            todo = step(verdict, entry is not None and same, rejoin, later,
                        len(self._background) < self.max_background)
            run = None if entry is None else entry.signal
            if isinstance(run, Run) and todo in (Step.LATER, Step.ACCEPT) and run.callback is None:
                run.callback = hook  # the first callback asked for a run is its
            if todo is Step.LATER and entry is not None:
                self._later(functools.partial(self._run, key, entry, scope), body, tab.deadline)
                await accepted(scope, send, self.status_path, key)
                return
            if todo is Step.RUN and entry is not None:
                if tab.deadline is not None:
                    detach()  # its caller may re-attach: a disconnect does not cancel it
                await self._run(key, entry, scope, receive, send)
                return
            if todo is Step.ACCEPT:
                answered_by_run()  # the run in flight will answer it: it starts none
                await accepted(scope, send, self.status_path, key)
                return
            if todo is Step.WAIT and entry is not None:
                try:
                    answer = await _wait(entry, tab.deadline)
                except BaseException:  # cancelled (its caller left): it started no run either
                    answered_by_run()
                    raise
                if answer is None:
                    continue  # the run ended without an answer: arrive again
                joined(tab, entry.signal)
                await _send(send, answer, b"wait")
                return
            if todo is Step.REPLAY and entry is not None and entry.answer is not None:
                joined(tab, entry.signal)  # (a kept answer is never a failure: nothing to note)
                await _send(send, entry.answer, b"replay")
                return
            if todo is Step.CONFLICT:
                await _send(send, CONFLICT, None)
                return
            break  # BYPASS, or RUN for a re-attach
        await (_refuse(send) if rejoin else self.app(scope, receive, send))

    async def _run(self, key: tuple[str, str, str], entry: Entry, scope: Scope,
                   receive: Receive, send: Send) -> None:
        capture = _Capture(send, self.policy.max_body)
        try:
            await self.app(scope, receive, capture)
        finally:
            answer = capture.answer()
            ran(entry.signal)
            with self._lock:
                if answer is None:
                    self.joins.abandon(key, entry)
                else:
                    self.joins.finish(key, entry, answer, asyncio.get_running_loop().time())
            run = entry.signal
            if isinstance(run, Run) and isinstance(run.wake, asyncio.Event):
                run.wake.set()  # this loop's: the run and its waiters share it
            if isinstance(run, Run) and run.callback is not None:
                self._deliver(run.callback, key, scope, answer)

    def _deliver(self, url: str, key: tuple[str, str, str], scope: Scope,
                 answer: Answer | None) -> None:
        """POST ``answer`` to ``url`` in a task of its own (at most ``max_background``)."""
        if self._hooks is None:
            return
        if len(self._deliveries) >= self.max_background:
            _stats.count("server.join.callback.dropped")
            return
        where = str(scope.get("root_path", "")) + location(self.status_path, key)
        task = asyncio.get_running_loop().create_task(
            adeliver(self._hooks, url, key[2], where, answer))
        self._deliveries.add(task)
        task.add_done_callback(self._deliveries.discard)

    async def _shared(self, key: tuple[str, str, str], fingerprint: bytes, rejoin: bool,
                      later: bool, hook: str | None, tab: Tab, scope: Scope, body: bytes,
                      receive: Receive, send: Send) -> None:
        """The same decisions, in the fleet's Redis store (``askonce.stores.join_redis``)."""
        store = self.store
        assert store is not None
        for _ in range(MAX_REARRIVALS):
            verdict, answer, token = await store.aarrive(key, fingerprint, self.policy,
                                                         may_run=not rejoin)
            _stats.count(f"server.join.{verdict.value}")
            room = len(self._background) < self.max_background
            found = token is not None if verdict is Verdict.RUN else (
                answer is not None if verdict is Verdict.REPLAY else True)
            todo = step(verdict, found, rejoin, later, room)
            if todo is Step.LATER and token is not None:
                self._later(functools.partial(self._run_shared, key, token, hook, scope), body,
                            tab.deadline)
                await accepted(scope, send, self.status_path, key)
                return
            if todo is Step.RUN and token is not None:
                if tab.deadline is not None:
                    detach()
                await self._run_shared(key, token, None, scope, receive, send)
                return
            if todo is Step.ACCEPT:
                answered_by_run()  # a run in the fleet answers it: this arrival starts none
                if hook is not None and room:
                    self._watch(key, scope, tab.deadline, hook)  # waits in the background
                else:
                    if hook is not None:
                        _stats.count("server.join.callback.dropped")
                    store.unwait()
                await accepted(scope, send, self.status_path, key)
                return
            if todo is Step.WAIT:
                try:
                    answer = await store.await_answer(key, wait_left(tab.deadline), self.policy)
                except BaseException:
                    answered_by_run()
                    raise
                if answer is None:
                    continue  # the run ended without an answer, or its holder died
                await _send(send, answer, b"wait")
                return
            if todo is Step.REPLAY and answer is not None:
                await _send(send, answer, b"replay")
                return
            if todo is Step.CONFLICT:
                await _send(send, CONFLICT, None)
                return
            break
        await (_refuse(send) if rejoin else self.app(scope, receive, send))

    async def _run_shared(self, key: tuple[str, str, str], token: bytes, hook: str | None,
                          scope: Scope, receive: Receive, send: Send) -> None:
        """Run the handler holding the store's lease; its answer goes to the store (and to
        ``hook``, the callback URL, if any)."""
        store = self.store
        assert store is not None
        capture = _Capture(send, self.policy.max_body)
        try:
            await self.app(scope, receive, capture)
        finally:
            answer = capture.answer()
            await store.afinish(key, token, answer, self.policy)
            if hook is not None:
                self._deliver(hook, key, scope, answer)

    def _watch(self, key: tuple[str, str, str], scope: Scope, deadline: float | None,
               hook: str) -> None:
        """Wait in the background for a run elsewhere in the fleet, and POST its answer to
        ``hook`` (the store's waiter slot this arrival took is the watcher's)."""
        store = self.store
        assert store is not None

        async def watch() -> None:
            answer = await store.await_answer(key, wait_left(deadline), self.policy)
            self._deliver(hook, key, scope, None if answer is store.TIMED_OUT else answer)

        task = asyncio.get_running_loop().create_task(watch())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _later(self, run: Callable[[Receive, Send], Awaitable[None]], body: bytes,
               deadline: float | None) -> None:
        """Run the question in the background (``Prefer: respond-async``), within its deadline
        (or ``MAX_WAIT``); its answer is kept as any other, for the status location."""
        async def receive() -> Message:
            if pending:
                return pending.pop()
            await asyncio.Event().wait()  # no caller to go away: the deadline ends the run
            raise AssertionError("unreachable")

        async def sink(message: Message) -> None:
            pass

        async def background() -> None:
            try:
                async with asyncio.timeout(wait_left(deadline)):  # (wait_for: see stores.aredis)
                    await run(receive, sink)
            except Exception:  # the run's own failure is its answer's business: none is kept
                _stats.count("server.join.async.failed")

        pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]
        _stats.count("server.join.async")
        task = asyncio.get_running_loop().create_task(background())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _status(self, scope: Scope, send: Send) -> None:
        """The status location of a question answered in the background: 200 (its answer), 202
        while it runs (``Prefer: wait=N`` holds up to N seconds), 404 for anyone else's."""
        found = located(str(scope.get("path", ""))[len(self.status_path):])
        who = principal_of(self.principal, scope)
        if found is None or who is None or scope.get("method") not in ("GET", "HEAD"):
            answer, _ = status_answer("unknown", None, "")
            await _send(send, answer, None)
            return
        key = (who, *found)
        wait = prefer(scope).wait or 0.0
        if self.store is not None:
            state, kept = await self.store.alook(key, self.policy, wait)
        else:
            state, kept = await self._look(key, wait)
        answer, replay = status_answer(state, kept, str(scope.get("root_path", ""))
                                       + location(self.status_path, key))
        await _send(send, answer, b"replay" if replay else None)

    async def _look(self, key: tuple[str, str, str], wait: float
                    ) -> tuple[str, Answer | None]:
        """The memory table's state of a question (see ``status_answer``), after waiting up to
        ``wait`` seconds for its run to end."""
        loop = asyncio.get_running_loop()
        with self._lock:
            entry = self.joins.peek(key, loop.time())
        if entry is not None and not entry.done and wait and _loop_of(entry) is loop:
            run = entry.signal
            if isinstance(run, Run) and isinstance(run.wake, asyncio.Event):
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await run.wake.wait()
        if entry is not None and entry.done and entry.answer is not None:
            return "answer", entry.answer
        return ("running", None) if entry is not None and not entry.done else ("none", None)


class _Capture:
    """Passes the response through and keeps a copy of it, up to ``limit`` bytes of body."""

    __slots__ = ("_body", "_complete", "_gone", "_headers", "_limit", "_over", "_send",
                 "_status")

    def __init__(self, send: Send, limit: int) -> None:
        self._send = send
        self._limit = limit
        self._status: int | None = None
        self._headers: tuple[tuple[bytes, bytes], ...] = ()
        self._body: list[bytes] = []
        self._over = False
        self._complete = False
        self._gone = False

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self._status = int(message["status"])
            self._headers = tuple((bytes(k), bytes(v)) for k, v in message.get("headers", ()))
        elif message["type"] == "http.response.body":
            chunk = bytes(message.get("body", b""))
            if not self._over:
                self._body.append(chunk)
                self._over = sum(map(len, self._body)) > self._limit
            if not message.get("more_body", False):
                self._complete = True
        if self._gone:
            return
        try:
            await self._send(message)
        except OSError:
            # The caller went away (ASGI servers may raise on a closed connection): the answer
            # is still kept for those who join the run.
            self._gone = True

    def answer(self) -> Answer | None:
        """The response sent, if it was sent whole and its body fits the limit; else ``None``
        (the waiters then arrive again and one of them runs the handler)."""
        if self._status is None or not self._complete:
            return None
        if self._over:
            _stats.count("server.join.too-large")
            return None
        return Answer(self._status, self._headers, b"".join(self._body))


async def _read_body(receive: Receive, limit: int) -> tuple[bytes | None, Receive]:
    """The request body (``None`` past ``limit``) and a ``receive`` that gives it to the app."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            # The caller went away before the whole body came: not a request to answer for
            # anyone else. The app gets what came, still unfinished, then the disconnect.
            return None, _replaying([{"type": "http.request", "body": b"".join(chunks),
                                      "more_body": True}, message], receive)
        chunk = bytes(message.get("body", b""))
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            if not message.get("more_body", False):
                body = b"".join(chunks)
                return None, _replaying([{"type": "http.request", "body": body,
                                          "more_body": False}], receive)
            return None, _replaying([{"type": "http.request", "body": b"".join(chunks),
                                      "more_body": True}], receive)
        if not message.get("more_body", False):
            break
    body = b"".join(chunks)
    return body, _replaying([{"type": "http.request", "body": body, "more_body": False}], receive)


def _replaying(buffered: list[Message], receive: Receive) -> Receive:
    async def replay() -> Message:
        if buffered:
            return buffered.pop(0)
        return await receive()

    return replay


def _hook(hooks: Hooks | None, scope: Scope, who: str) -> str | None:
    """The callback URL the request asks for (``askonce-callback``), if allowed."""
    return asked(hooks, (v.decode("latin-1") for k, v in scope.get("headers", ())
                         if k == CALLBACK_HEADER), who)


def _loop_of(entry: Entry) -> object:
    run = entry.signal
    return run.owner if isinstance(run, Run) else None


async def _wait(entry: Entry, deadline: float | None) -> Answer | None:
    run = entry.signal
    if not isinstance(run, Run) or not isinstance(run.wake, asyncio.Event):
        return None
    try:
        async with asyncio.timeout(wait_left(deadline)):
            await run.wake.wait()
    except TimeoutError:
        return Answer(503, (), b"")  # the outer middleware answers a passed deadline itself
    return entry.answer


async def _send(send: Send, answer: Answer, joined: bytes | None) -> None:
    headers = list(answer.headers)
    if joined is not None:
        headers.append((JOINED_HEADER, joined))
        answered_by_run()
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": answer.body})


