"""Answer once at a gRPC callee: a repeated question joins the run in flight or is replayed.

``JoinServerInterceptor`` goes *inside* :class:`~askonce.integrations.grpc.AskonceServerInterceptor`
(after it in the list: gRPC runs the first interceptor outermost), which binds the question and
counts every arrival in the ledger::

    server = grpc.server(pool, interceptors=[AskonceServerInterceptor(layer="billing"),
                                             JoinServerInterceptor()])

``AsyncJoinServerInterceptor`` is the same for ``grpc.aio`` servers, inside
:class:`~askonce.integrations.grpc.AsyncAskonceServerInterceptor`. Unary-unary methods only
(streams pass through). The decisions are :class:`askonce.core.join.Joins`'s, as for
:mod:`~askonce.integrations.asgi_join`, per (principal, full method name, key), where the request
compared is the serialized request message: the first arrival runs the handler; one that arrives
while it runs waits for its result (the response message, or its status code, details and trailing
metadata); one that arrives after it finished, within the policy's ``ttl``, gets it again; the same
key with another request message is refused with ``FAILED_PRECONDITION``. Answers sent this way
carry the trailing metadata ``askonce-joined: wait`` or ``replay``, and every reply of a question
it handles says ``j``, so askonce clients re-attach a timed-out try instead of failing closed. A
re-attach with no run to join is refused (``UNAVAILABLE``, ``b=0, dnr, r=exhausted``), never run.

Kept for replay: ``OK`` and the caller's own faults (``INVALID_ARGUMENT``, ``NOT_FOUND``, ...), when
the serialized response is at most ``max_body`` bytes (a larger one goes to the waiters of its run
but is not kept: ``server.join.too-large``). A run that raised an unexpected exception leaves no
answer: its waiters arrive again. ``principal``: a callable of the servicer context naming who
asks (after your authentication); without it every caller is one principal.

A run outlives its caller's attempt (``askonce.integrations._join.detach``): on ``grpc.aio`` it runs
in a task of its own, bounded by the question's deadline, so a caller whose gRPC deadline is shorter
than the work comes back for it (the re-attach) instead of cancelling it; a sync server never
cancels a handler anyway. The handler sees a servicer context that records what it sets (code,
details, trailing metadata) and passes everything to the real one.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

import grpc
from grpc import aio

from askonce import _stats
from askonce._context import current_frame
from askonce.core.join import Answer, Entry, JoinPolicy, Joins, Verdict
from askonce.core.question import Tab
from askonce.core.wire import QUESTION_HEADER, REPLY_HEADER, Reply, is_rejoin
from askonce.errors import reply_of
from askonce.integrations._join import (
    CONFLICT_BODY,
    JOINED_HEADER,
    MAX_REARRIVALS,
    MAX_WAIT,
    Run,
    announce,
    answered_by_run,
    detach,
    digest,
    joined,
    principal_of,
    ran,
)
from askonce.integrations._server import PassedOn, note_failure

__all__ = ["JOINED", "AsyncJoinServerInterceptor", "JoinServerInterceptor"]

Code = grpc.StatusCode
JOINED = JOINED_HEADER.decode("ascii")
Metadata = tuple[tuple[str, str | bytes], ...]

# The statuses kept for replay besides OK: the caller's own faults (as HTTP keeps 4xx).
KEPT = frozenset({Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.ALREADY_EXISTS,
                  Code.PERMISSION_DENIED, Code.UNAUTHENTICATED, Code.FAILED_PRECONDITION,
                  Code.OUT_OF_RANGE, Code.UNIMPLEMENTED})
_BY_NUMBER = {c.value[0]: c for c in Code}
CONFLICT = CONFLICT_BODY.decode("ascii")
REFUSED = "askonce: no run of this question to join here"
LATE = "askonce: the run this call joined did not answer within its deadline"
EXPIRED = "askonce: this question's deadline passed"
# What gRPC itself answers when a message cannot be (de)serialized.
UNREAD = "Exception deserializing request!"
UNWRITTEN = "Failed to serialize response!"


# --- a run's result as a join answer --------------------------------------------------------------


def _answer(code: grpc.StatusCode, details: str | None, trailing: Metadata, body: bytes) -> Answer:
    """A gRPC result in the core's shape: ``status`` 200 (OK), 400 (kept: the caller's fault) or
    500 (not kept); the code and details as gRPC's own trailers say them; the message as body."""
    status = 200 if code == Code.OK else 400 if code in KEPT else 500
    headers = [(b"grpc-status", str(code.value[0]).encode("ascii")),
               (b"grpc-message", (details or "").encode("utf-8", "replace"))]
    for key, value in trailing:
        if key != REPLY_HEADER:  # every arrival gets its own reply
            raw = value if isinstance(value, bytes) else value.encode("utf-8", "replace")
            headers.append((key.encode("ascii", "replace"), raw))
    return Answer(status, tuple(headers), body)


def _result(answer: Answer) -> tuple[grpc.StatusCode, str, Metadata]:
    """What :func:`_answer` wrote: the code, the details, the trailing metadata."""
    code, details, trailing = Code.UNKNOWN, "", []
    for key, value in answer.headers:
        if key == b"grpc-status":
            code = _BY_NUMBER.get(int(value), Code.UNKNOWN)
        elif key == b"grpc-message":
            details = value.decode("utf-8", "replace")
        else:
            name = key.decode("ascii", "replace")
            trailing.append((name, value if name.endswith("-bin")
                             else value.decode("utf-8", "replace")))
    return code, details, tuple(trailing)


def _late() -> Answer:
    return _answer(Code.DEADLINE_EXCEEDED, LATE, (), b"")


class _Seen:
    """What a handler set on its context: the status it chose, and its trailing metadata."""

    __slots__ = ("code", "details", "trailing")

    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None
        self.details: str | None = None
        self.trailing: Metadata = ()

    def aborted(self, code: Any, details: Any, trailing: Any) -> None:
        self.code, self.details = code, None if details is None else str(details)
        if trailing:
            self.trailing = tuple(trailing)

    def answer(self, body: bytes) -> Answer:
        """The handler returned ``body``: OK, unless it set another code."""
        code = self.code if isinstance(self.code, grpc.StatusCode) else Code.OK
        return _answer(code, self.details, self.trailing, body if code == Code.OK else b"")

    def failed(self, exc: Exception) -> tuple[Answer | None, BaseException | None]:
        """The handler raised ``exc``: the status it aborted with (or set), a give-up's
        ``UNAVAILABLE`` (and the give-up, for the waiters' replies), or no answer."""
        if isinstance(self.code, grpc.StatusCode) and self.code != Code.OK:
            return _answer(self.code, self.details, self.trailing, b""), None
        reply = reply_of(exc)
        if reply is not None:  # the server interceptor answers it UNAVAILABLE, with the reply
            text = f"askonce: {reply.reason or 'gave up'}"
            return _answer(Code.UNAVAILABLE, text, self.trailing, b""), exc
        return None, None


class _End:
    """Settles a run once (its answer to the join table, its waiters woken): when its handler
    aborts, before gRPC sends the status, or when the handler returns or raises."""

    __slots__ = ("done", "entry", "joining", "scope", "wake")

    def __init__(self, joining: _Joining, scope: tuple[str, str, str], entry: Entry,
                 wake: type[Any]) -> None:
        self.joining, self.scope, self.entry, self.wake = joining, scope, entry, wake
        self.done = False

    def __call__(self, answer: Answer | None, gave_up: BaseException | None = None) -> None:
        with self.joining._lock:  # a handler may abort from a thread of its own
            if self.done:
                return
            self.done = True
        self.joining._settle(self.scope, self.entry, answer, gave_up)
        run = self.entry.signal
        wake = run.wake if isinstance(run, Run) else None
        if isinstance(wake, self.wake):  # the kind this server's runs wake their waiters with
            wake.set()


_ABORTED = Exception("aborted")  # what a handler's abort raised, for _Seen.failed


def _later(answer: Answer | None) -> None:
    """A sync server's abort: the run is settled when the handler has unwound."""


class _Recording:
    """The servicer context a handler sees: the real one (or the server interceptor's), with what
    the handler sets recorded for the run's waiters.

    ``ended`` is called with the run's answer when the handler aborts, before the abort: an aio
    server sends an abort's status at once, and a caller that has it may ask again before the
    handler's frame unwinds, so the join table must know by then that the run ended. (A sync
    server sends it after the unwind: there ``ended`` does nothing, and the run ends as it
    returns.)"""

    __slots__ = ("_ctx", "ended", "seen")

    def __init__(self, ctx: Any, ended: Callable[[Answer | None], None]) -> None:
        self._ctx = ctx
        self.seen = _Seen()
        self.ended = ended

    def _aborting(self, code: Any, details: Any, trailing: Any) -> None:
        self.seen.aborted(code, details, trailing)
        self.ended(self.seen.failed(_ABORTED)[0])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)

    def set_code(self, code: grpc.StatusCode) -> None:
        self.seen.code = code
        self._ctx.set_code(code)

    def set_details(self, details: str) -> None:
        self.seen.details = details
        self._ctx.set_details(details)

    def set_trailing_metadata(self, trailing_metadata: Any) -> None:
        self.seen.trailing = tuple(trailing_metadata)
        self._ctx.set_trailing_metadata(trailing_metadata)


class _SyncRecording(_Recording):
    __slots__ = ()

    def abort(self, code: grpc.StatusCode, details: str = "", *more: Any) -> NoReturn:
        self._aborting(code, details, more[0] if more else ())
        self._ctx.abort(code, details, *more)
        raise AssertionError("abort() returned")  # it always raises

    def abort_with_status(self, status: grpc.Status) -> NoReturn:
        self._aborting(status.code, status.details, status.trailing_metadata)
        self._ctx.abort_with_status(status)
        raise AssertionError("abort_with_status() returned")


class _AsyncRecording(_Recording):
    __slots__ = ()

    async def abort(self, code: grpc.StatusCode, details: str = "",
                    trailing_metadata: Any = ()) -> NoReturn:
        self._aborting(code, details, trailing_metadata)
        await self._ctx.abort(code, details, trailing_metadata)
        raise AssertionError("abort() returned")

    async def abort_with_status(self, status: grpc.Status) -> NoReturn:
        await self.abort(status.code, status.details, status.trailing_metadata)


class _Codec:
    """The method's own (de)serializers: the join layer reads and keeps the messages as bytes."""

    __slots__ = ("read", "write")

    def __init__(self, handler: Any) -> None:
        self.read: Callable[[bytes], Any] | None = handler.request_deserializer
        self.write: Callable[[Any], bytes] | None = handler.response_serializer

    def request(self, raw: bytes) -> tuple[bool, Any]:
        if self.read is None:
            return True, raw
        try:
            return True, self.read(raw)
        except Exception:
            _stats.count("server.join.unreadable")
            return False, None

    def response(self, message: Any) -> bytes | None:
        try:
            body = message if self.write is None else self.write(message)
        except Exception:
            body = None
        if not isinstance(body, bytes):
            _stats.count("server.join.unwritable")
            return None
        return body


# --- the interceptors ----------------------------------------------------------------------------


class _Joining:
    """What the sync and aio join interceptors share: the policy, the principal callable, the
    table of questions and its lock."""

    def __init__(self, *, policy: JoinPolicy = JoinPolicy(),
                 principal: Callable[[Any], str] | None = None) -> None:
        if not isinstance(policy, JoinPolicy):
            raise ValueError(f"policy must be a JoinPolicy, got {policy!r}")
        if principal is not None and not callable(principal):
            raise ValueError(f"principal must be a callable of the servicer context, "
                             f"got {principal!r}")
        self.policy = policy
        self.principal = principal
        self.joins = Joins(policy)
        self._lock = threading.Lock()  # sync handlers run on many threads

    def _handler(self, handler: Any, details: Any,
                 serve: Callable[[Any, str, bool, _Codec], Any]) -> Any:
        if handler is None or handler.request_streaming or handler.response_streaming:
            return handler  # streams pass through
        method = details.method
        method = method.decode("ascii", "replace") if isinstance(method, bytes) else str(method)
        rejoin = any(k == QUESTION_HEADER and is_rejoin(v)
                     for k, v in details.invocation_metadata or ())
        return grpc.unary_unary_rpc_method_handler(
            serve(handler.unary_unary, method, rejoin, _Codec(handler)))

    def _arrive(self, scope: tuple[str, str, str], fingerprint: bytes, rejoin: bool, tab: Tab,
                loop: object, wake: object) -> tuple[Verdict, Entry | None]:
        with self._lock:
            verdict, entry = self.joins.arrive(scope, fingerprint, _stats.monotonic())
            if verdict is Verdict.RUN and entry is not None:
                if rejoin:  # nothing to join: the lost run may still be going elsewhere
                    self.joins.abandon(scope, entry)
                else:
                    entry.signal = Run(loop, wake, tab)
        _stats.count(f"server.join.{verdict.value}")
        return verdict, entry

    def _settle(self, scope: tuple[str, str, str], entry: Entry, answer: Answer | None,
                gave_up: BaseException | None) -> None:
        """The run ended: its answer to its waiters (and kept, if it may be), or none."""
        run = entry.signal
        if answer is None or answer.status != 200:
            ran(run)  # what an error answer stands for, for the waiters' replies
        if gave_up is not None and isinstance(run, Run):
            run.noted = gave_up
        if answer is not None and len(answer.body) > self.policy.max_body:
            _stats.count("server.join.too-large")
        with self._lock:
            if answer is None:
                self.joins.abandon(scope, entry)
            else:
                self.joins.finish(scope, entry, answer, _stats.monotonic())

    def _bound(self, ctx: Any) -> tuple[Tab, str | None] | None:
        """The question the server interceptor bound, and who asks (``None``: the principal
        callable raised); ``None``: do not join (no question bound, or one this layer minted: no
        one else knows its key)."""
        frame = current_frame()
        if frame is None:
            _stats.count("server.join.unbound")  # placed outside the askonce interceptor
            return None
        tab = frame[0]
        if tab.minted_here:
            return None
        announce()
        who = principal_of(self.principal, ctx)
        return tab, who


class _Wake:
    """How a sync run wakes its waiters: each waits on an event of its own, which its RPC's end
    sets too (its caller left, its gRPC deadline passed), so a waiter holds its thread no longer
    than its call lasts."""

    __slots__ = ("_done", "_events", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: set[threading.Event] = set()
        self._done = False

    def set(self) -> None:
        with self._lock:
            self._done, events, self._events = True, self._events, set()
        for event in events:
            event.set()

    def wait(self, ctx: Any, timeout: float) -> bool:
        """Whether the run ended within ``timeout`` seconds, while this waiter's call lasted."""
        mine = threading.Event()
        with self._lock:
            if self._done:
                return True
            self._events.add(mine)
        add = getattr(ctx, "add_callback", None)
        if not callable(add) or add(mine.set) is not False:  # False: the call has already ended
            mine.wait(timeout)
        with self._lock:
            self._events.discard(mine)  # a waiter gone before the run's end leaves nothing behind
            return self._done


def _refuse(ctx: Any) -> Any:
    """A re-attach with no run to join: refused, never run; the reply says none is left (what was
    held for the lost run is not this callee's to give back). On aio: the abort to await."""
    _stats.count("server.join.refused-rejoin")
    note_failure(PassedOn(Reply(0, True, "exhausted")))
    return ctx.abort(Code.UNAVAILABLE, REFUSED)


def _left(tab: Tab) -> float:
    """How long a waiter may wait: its question's time left, at most ``MAX_WAIT``. (Its own gRPC
    deadline ends its call, and the wait with it; a waiter never answers for it: its caller's
    own deadline, not an answer, must tell it that the try is lost, so that it re-attaches.)"""
    left = MAX_WAIT
    if tab.deadline is not None:
        left = min(left, tab.deadline - _stats.monotonic())
    return max(0.0, left)


class JoinServerInterceptor(_Joining, grpc.ServerInterceptor):
    """Sync server; see the module docstring. ``policy``: how long answers are kept, how many,
    how large; ``principal(context) -> str``: who asks (an answer never crosses principals)."""

    _eager = False  # its handlers' aborts are sent at once (on an aio server's threads)

    def intercept_service(self, continuation: Any,
                          handler_call_details: grpc.HandlerCallDetails) -> Any:
        return self._handler(continuation(handler_call_details), handler_call_details,
                             self._serve)

    def _serve(self, behavior: Callable[[Any, Any], Any], method: str, rejoin: bool,
               codec: _Codec) -> Callable[[bytes, Any], Any]:
        def serve(raw: bytes, ctx: Any) -> Any:
            ok, request = codec.request(raw)
            if not ok:
                ctx.abort(Code.INTERNAL, UNREAD)
            bound = self._bound(ctx)
            who = None if bound is None else bound[1]
            if bound is None or who is None:
                if bound is not None and rejoin:
                    _refuse(ctx)
                return _plain(behavior, codec, request, ctx)
            tab = bound[0]
            scope = (who, method, tab.key)
            fingerprint = digest(b"", raw)
            for _ in range(MAX_REARRIVALS):
                verdict, entry = self._arrive(scope, fingerprint, rejoin, tab, None, _Wake())
                if verdict is Verdict.RUN and entry is not None and not rejoin:
                    return self._run(scope, entry, behavior, codec, request, ctx)
                if verdict is Verdict.WAIT and entry is not None:
                    run = entry.signal
                    if not isinstance(run, Run) or not isinstance(run.wake, _Wake):
                        _stats.count("server.join.other-loop")
                        break
                    answer = entry.answer if run.wake.wait(ctx, _left(tab)) else _late()
                    if answer is None:
                        continue  # the run ended without an answer: arrive again
                    joined(tab, run)
                    return _send(ctx, answer, "wait")
                if verdict is Verdict.REPLAY and entry is not None and entry.answer is not None:
                    joined(tab, entry.signal)
                    return _send(ctx, entry.answer, "replay")
                if verdict is Verdict.CONFLICT:
                    ctx.abort(Code.FAILED_PRECONDITION, CONFLICT)
                break  # BYPASS, or RUN for a re-attach
            if rejoin:
                _refuse(ctx)
            return _plain(behavior, codec, request, ctx)

        return serve

    def _run(self, scope: tuple[str, str, str], entry: Entry, behavior: Callable[[Any, Any], Any],
             codec: _Codec, request: Any, ctx: Any) -> bytes | None:
        end = _End(self, scope, entry, _Wake)
        seen = _SyncRecording(ctx, end if self._eager else _later)
        answer: Answer | None = None
        gave_up: BaseException | None = None
        try:
            body = codec.response(behavior(request, seen))
            if body is None:
                seen.abort(Code.INTERNAL, UNWRITTEN)
            answer = seen.seen.answer(body)
            return body  # with a code of its own set, gRPC sends that code
        except Exception as exc:
            answer, gave_up = seen.seen.failed(exc)
            raise
        finally:
            end(answer, gave_up)


def _plain(behavior: Callable[[Any, Any], Any], codec: _Codec, request: Any, ctx: Any) -> Any:
    """The handler, unjoined: its response serialized as gRPC would have."""
    body = codec.response(behavior(request, ctx))
    if body is None:
        ctx.abort(Code.INTERNAL, UNWRITTEN)
    return body


def _send(ctx: Any, answer: Answer, how: str) -> bytes:
    """A run's answer for another arrival, marked ``askonce-joined: <how>``."""
    code, details, trailing = _result(answer)
    ctx.set_trailing_metadata((*trailing, (JOINED, how)))
    answered_by_run()
    if code != Code.OK:
        ctx.abort(code, details)
    return answer.body


class AsyncJoinServerInterceptor(_Joining, aio.ServerInterceptor):
    """The ``grpc.aio`` form of :class:`JoinServerInterceptor`, inside
    :class:`~askonce.integrations.grpc.AsyncAskonceServerInterceptor`. A sync handler on the aio
    server (run in its thread pool) is joined as on a sync server. A run goes on in a task of its
    own when its caller goes away, bounded by the question's deadline."""

    def __init__(self, *, policy: JoinPolicy = JoinPolicy(),
                 principal: Callable[[Any], str] | None = None) -> None:
        super().__init__(policy=policy, principal=principal)
        self._sync = JoinServerInterceptor(policy=policy, principal=principal)
        self._sync.joins, self._sync._lock = self.joins, self._lock  # one table for both
        self._sync._eager = True
        self._background: set[asyncio.Task[Any]] = set()  # runs detached from their callers

    async def intercept_service(self, continuation: Any,
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        if handler is not None and not inspect.iscoroutinefunction(handler.unary_unary):
            return self._handler(handler, handler_call_details, self._sync._serve)
        return self._handler(handler, handler_call_details, self._serve)

    def _serve(self, behavior: Callable[[Any, Any], Awaitable[Any]], method: str, rejoin: bool,
               codec: _Codec) -> Callable[[bytes, Any], Awaitable[Any]]:
        async def serve(raw: bytes, ctx: Any) -> Any:
            ok, request = codec.request(raw)
            if not ok:
                await ctx.abort(Code.INTERNAL, UNREAD)
            bound = self._bound(ctx)
            who = None if bound is None else bound[1]
            if bound is None or who is None:
                if bound is not None and rejoin:
                    await _refuse(ctx)
                return await _aplain(behavior, codec, request, ctx)
            tab = bound[0]
            scope = (who, method, tab.key)
            fingerprint = digest(b"", raw)
            loop = asyncio.get_running_loop()
            for _ in range(MAX_REARRIVALS):
                verdict, entry = self._arrive(scope, fingerprint, rejoin, tab, loop,
                                              asyncio.Event())
                if verdict is Verdict.RUN and entry is not None and not rejoin:
                    return await self._run(scope, entry, behavior, codec, request, ctx, tab)
                if verdict is Verdict.WAIT and entry is not None:
                    run = entry.signal
                    if not isinstance(run, Run) or run.owner is not loop \
                            or not isinstance(run.wake, asyncio.Event):
                        _stats.count("server.join.other-loop")  # an asyncio.Event serves one loop
                        break
                    try:
                        answer = await _wait(run.wake, entry, _left(tab))
                    except BaseException:  # cancelled (its caller left): it started no run either
                        answered_by_run()
                        raise
                    if answer is None:
                        continue  # the run ended without an answer: arrive again
                    joined(tab, run)
                    return await _asend(ctx, answer, "wait")
                if verdict is Verdict.REPLAY and entry is not None and entry.answer is not None:
                    joined(tab, entry.signal)
                    return await _asend(ctx, entry.answer, "replay")
                if verdict is Verdict.CONFLICT:
                    await ctx.abort(Code.FAILED_PRECONDITION, CONFLICT)
                break  # BYPASS, or RUN for a re-attach
            if rejoin:
                await _refuse(ctx)
            return await _aplain(behavior, codec, request, ctx)

        return serve

    async def _run(self, scope: tuple[str, str, str], entry: Entry,
                   behavior: Callable[[Any, Any], Awaitable[Any]], codec: _Codec, request: Any,
                   ctx: Any, tab: Tab) -> bytes | None:
        end = _End(self, scope, entry, asyncio.Event)
        seen = _AsyncRecording(ctx, end)
        deadline = tab.deadline

        async def run() -> bytes | None:
            answer: Answer | None = None
            gave_up: BaseException | None = None
            try:
                left = None if deadline is None else max(0.0, deadline - _stats.monotonic())
                try:
                    async with asyncio.timeout(left):
                        response = await behavior(request, seen)
                except TimeoutError:
                    if deadline is None or _stats.monotonic() < deadline:
                        raise  # the handler's own
                    await seen.abort(Code.DEADLINE_EXCEEDED, EXPIRED)
                body = codec.response(response)
                if body is None:
                    await seen.abort(Code.INTERNAL, UNWRITTEN)
                answer = seen.seen.answer(body)
                return body
            except Exception as exc:
                answer, gave_up = seen.seen.failed(exc)
                raise
            finally:
                end(answer, gave_up)

        if deadline is None:
            return await run()  # no deadline to bound it by: it ends with its caller
        detach()  # its caller may re-attach: the caller's going away does not cancel it
        task = asyncio.get_running_loop().create_task(run())
        self._background.add(task)
        task.add_done_callback(self._forget)
        return await asyncio.shield(task)

    def _forget(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a run whose caller left has no one to raise it to


async def _aplain(behavior: Callable[[Any, Any], Awaitable[Any]], codec: _Codec, request: Any,
                  ctx: Any) -> Any:
    body = codec.response(await behavior(request, ctx))
    if body is None:
        await ctx.abort(Code.INTERNAL, UNWRITTEN)
    return body


async def _wait(wake: asyncio.Event, entry: Entry, left: float) -> Answer | None:
    try:
        await asyncio.wait_for(wake.wait(), left)
    except TimeoutError:
        return _late()
    return entry.answer


async def _asend(ctx: Any, answer: Answer, how: str) -> bytes:
    code, details, trailing = _result(answer)
    trailing = (*trailing, (JOINED, how))
    ctx.set_trailing_metadata(trailing)
    answered_by_run()
    if code != Code.OK:
        await ctx.abort(code, details, trailing)
    return answer.body
