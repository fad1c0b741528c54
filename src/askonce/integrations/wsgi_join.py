"""Answer once at a WSGI callee: a repeated question joins the run in flight or is replayed.

``JoinWSGIMiddleware`` goes *inside* :class:`~askonce.integrations.wsgi.AskonceWSGIMiddleware`::

    app.wsgi_app = AskonceWSGIMiddleware(JoinWSGIMiddleware(app.wsgi_app), layer="orders")

The decisions, headers, counters and bounds are those of
:mod:`askonce.integrations.asgi_join` (per principal, method and path, key; ``askonce-joined:
wait|replay``; 422 for the same key with another request; ``askonce-reply`` member ``j``), for a
threaded server: a waiter blocks its worker thread until the run answers or the waiter's deadline
passes (then a bare 503). A request body is read for comparison only when its ``CONTENT_LENGTH``
is given and at most the policy's ``max_body`` (otherwise it runs unjoined,
``server.join.unread``). The response is buffered up to ``max_body``; a larger one is streamed on
and not kept (``server.join.too-large``): its waiters run the handler themselves. Responses the app
sends through the legacy ``write`` callable are kept too. ``store``: a
:class:`~askonce.stores.join_redis.RedisJoinStore` shares the joins of a fleet of replicas.

Async mode and callbacks are ``asgi_join``'s too: the question runs in a pool of at most
``max_background`` background threads, the request's context (its question and deadline) copied
there; a WSGI handler cannot be cancelled, so the deadline stops the askonce calls it makes and
its answer is kept when it returns. Callbacks are delivered from those threads.
"""

from __future__ import annotations

import contextvars
import functools
import io
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from itertools import chain
from typing import TYPE_CHECKING, Any

from askonce import _stats
from askonce._context import current_frame
from askonce.core.join import Answer, Entry, JoinPolicy, Preference, Verdict, parse_prefer
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
    digest,
    joined,
    principal_of,
    ran,
    step,
    wait_left,
)
from askonce.integrations._join_async import (
    MAX_LONG_POLL,
    STATUS_PATH,
    accepted_answer,
    located,
    location,
    status_answer,
)
from askonce.integrations.callbacks import Allow, Hooks, asked, deliver
from askonce.integrations.wsgi import Environ, StartResponse, WSGIApp

if TYPE_CHECKING:
    from askonce.core.signing import Secret
    from askonce.stores.join_redis import RedisJoinStore

__all__ = ["JoinWSGIMiddleware"]

_JOINED = JOINED_HEADER.decode("ascii")
_BACKGROUND = contextvars.ContextVar("askonce_join_background", default=False)


class JoinWSGIMiddleware(Joining):
    """See the module docstring. ``principal(environ) -> str``: who asks (after your
    authentication); an answer is never replayed to another principal."""

    app: WSGIApp

    def __init__(self, app: WSGIApp, *, policy: JoinPolicy = JoinPolicy(),
                 principal: Callable[[Environ], str] | None = None,
                 store: RedisJoinStore | None = None, status_path: str = STATUS_PATH,
                 max_background: int = 16, callbacks: Allow | None = None,
                 callback_secret: Secret | Sequence[Secret] | None = None) -> None:
        super().__init__(app, policy, principal, kind="a WSGI", request="environ")
        if store is not None and not callable(getattr(store, "arrive", None)):
            raise ValueError(f"store must be a RedisJoinStore, got {store!r}")
        if not isinstance(status_path, str) or not status_path.startswith("/") \
                or not status_path.endswith("/"):
            raise ValueError(f"status_path must start and end with '/', got {status_path!r}")
        if not isinstance(max_background, int) or not 0 <= max_background <= 1000:
            raise ValueError(f"max_background must be an int within 0..1000, "
                             f"got {max_background!r}")
        self.store = store
        self.status_path = status_path
        self.max_background = max_background
        self._hooks = Hooks.build(callbacks, callback_secret)
        self._pool: ThreadPoolExecutor | None = None
        self._busy = 0  # background runs and deliveries submitted and not yet over

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        if str(environ.get("PATH_INFO", "")).startswith(self.status_path):
            return self._status(environ, start_response)
        frame = current_frame()
        if frame is None or frame[0].minted_here:
            return self.app(environ, start_response)
        rejoin = is_rejoin(str(environ.get("HTTP_ASKONCE_QUESTION", "")))
        body = _read_body(environ, self.policy.max_body)
        announce()
        who = principal_of(self.principal, environ)
        if body is None or who is None:
            _stats.count("server.join.unread" if body is None else "server.join.principal-error")
            return _refuse(start_response) if rejoin else self.app(environ, start_response)
        tab = frame[0]
        key = (who, f"{environ.get('REQUEST_METHOD', '')} {environ.get('PATH_INFO', '')}",
               tab.key)
        fingerprint = digest(str(environ.get("QUERY_STRING", "")).encode("latin-1", "replace"),
                             body)
        later = _prefer(environ).respond_async and not rejoin
        hook = asked(self._hooks, _lines(environ.get("HTTP_ASKONCE_CALLBACK")), who) \
            if later else None
        if self.store is not None:
            return self._shared(key, fingerprint, rejoin, later, hook, tab, environ, body,
                                start_response)
        for _ in range(MAX_REARRIVALS):
            with self._lock:
                verdict, entry = self.joins.arrive(key, fingerprint, _stats.monotonic())
                if verdict is Verdict.RUN and entry is not None:
                    if rejoin:  # nothing to join: the lost run may still be going elsewhere
                        self.joins.abandon(key, entry)
                    else:
                        entry.signal = Run(None, threading.Event(), tab)
            _stats.count(f"server.join.{verdict.value}")
            todo = step(verdict, entry is not None, rejoin, later, self._room())
            run = None if entry is None else entry.signal
            if isinstance(run, Run) and todo in (Step.LATER, Step.ACCEPT) and run.callback is None:
                run.callback = hook  # the first callback asked for a run is its
            if todo is Step.LATER and entry is not None:
                if self._submit(_background, functools.partial(self._run, key, entry), environ,
                                body):
                    return self._accepted(environ, start_response, key)
                _stats.count("server.join.async.full")  # taken since: answered inline
                if isinstance(run, Run):
                    run.callback = None
            if todo in (Step.RUN, Step.LATER) and entry is not None:
                return self._run(key, entry, environ, start_response)
            if todo is Step.ACCEPT:
                answered_by_run()  # the run in flight will answer it: it starts none
                return self._accepted(environ, start_response, key)
            if todo is Step.WAIT and entry is not None:
                answer = _wait(entry, tab.deadline)
                if answer is None:
                    continue  # the run ended without an answer: arrive again
                joined(tab, entry.signal)
                return _send(start_response, answer, "wait")
            if todo is Step.REPLAY and entry is not None and entry.answer is not None:
                joined(tab, entry.signal)
                return _send(start_response, entry.answer, "replay")
            if todo is Step.CONFLICT:
                return _send(start_response, CONFLICT, None)
            break  # BYPASS, or RUN for a re-attach
        return _refuse(start_response) if rejoin else self.app(environ, start_response)

    def _shared(self, key: tuple[str, str, str], fingerprint: bytes, rejoin: bool, later: bool,
                hook: str | None, tab: Tab, environ: Environ, body: bytes,
                start_response: StartResponse) -> Iterable[bytes]:
        """The same decisions, in the fleet's Redis store (``askonce.stores.join_redis``)."""
        store = self.store
        assert store is not None
        for _ in range(MAX_REARRIVALS):
            verdict, answer, token = store.arrive(key, fingerprint, self.policy,
                                                  may_run=not rejoin)
            _stats.count(f"server.join.{verdict.value}")
            found = token is not None if verdict is Verdict.RUN else (
                answer is not None if verdict is Verdict.REPLAY else True)
            todo = step(verdict, found, rejoin, later, self._room())
            if todo in (Step.RUN, Step.LATER) and token is not None:
                def finish(answer: Answer | None, token: bytes = token,
                           hook: str | None = hook if todo is Step.LATER else None) -> None:
                    store.finish(key, token, answer, self.policy)
                    if hook is not None:
                        self._deliver(hook, key, environ, answer)

                run = functools.partial(self._run, key, None, finish=finish)
                if todo is Step.LATER and self._submit(_background, run, environ, body):
                    return self._accepted(environ, start_response, key)
                if todo is Step.LATER:
                    _stats.count("server.join.async.full")  # taken since: answered inline
                    run = functools.partial(self._run, key, None, finish=functools.partial(
                        finish, hook=None))
                return run(environ, start_response)
            if todo is Step.ACCEPT:
                answered_by_run()  # a run in the fleet answers it: this arrival starts none
                if hook is None or not self._submit(self._watch, key, tab.deadline, hook,
                                                    environ):
                    if hook is not None:
                        _stats.count("server.join.callback.dropped")
                    store.unwait()
                return self._accepted(environ, start_response, key)
            if todo is Step.WAIT:
                answer = store.wait(key, wait_left(tab.deadline), self.policy)
                if answer is None:
                    continue  # the run ended without an answer, or its holder died
                return _send(start_response, answer, "wait")
            if todo is Step.REPLAY and answer is not None:
                return _send(start_response, answer, "replay")
            if todo is Step.CONFLICT:
                return _send(start_response, CONFLICT, None)
            break
        return _refuse(start_response) if rejoin else self.app(environ, start_response)

    def _run(self, key: tuple[str, str, str], entry: Entry | None, environ: Environ,
             start_response: StartResponse,
             finish: Callable[[Answer | None], None] | None = None) -> Iterable[bytes]:
        """Run the handler, keeping its answer: in the table (``entry``) or by ``finish``."""
        status: list[int] = []
        headers: list[tuple[bytes, bytes]] = []
        chunks: list[bytes] = []

        def capture(line: str, sent: list[tuple[str, str]], exc_info: Any = None) -> Any:
            status[:] = [int(line.split(" ", 1)[0])]
            headers[:] = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in sent]
            start_response(line, sent) if exc_info is None else start_response(line, sent,
                                                                                exc_info)
            return chunks.append  # the legacy write(): kept, and sent before the body

        answer: Answer | None = None
        try:
            result = self.app(environ, capture)
            try:
                rest: Iterator[bytes] = iter(result)
                size = sum(map(len, chunks))
                for chunk in rest:
                    chunks.append(chunk)
                    size += len(chunk)
                    if size > self.policy.max_body:
                        _stats.count("server.join.too-large")
                        return _Streamed(chain(chunks, rest), result)
            except BaseException:
                _close(result)  # as the server would have, had it iterated the body itself
                raise
            _close(result)
            if status:
                answer = Answer(status[0], tuple(headers), b"".join(chunks))
            return [answer.body] if answer is not None else chunks
        finally:
            if entry is None:
                if finish is not None:
                    finish(answer)
            else:
                self._settle(key, entry, answer, environ)

    def _settle(self, key: tuple[str, str, str], entry: Entry, answer: Answer | None,
                environ: Environ) -> None:
        ran(entry.signal)
        with self._lock:
            if answer is None:
                self.joins.abandon(key, entry)
            else:
                self.joins.finish(key, entry, answer, _stats.monotonic())
        run = entry.signal
        if isinstance(run, Run) and isinstance(run.wake, threading.Event):
            run.wake.set()
        if isinstance(run, Run) and run.callback is not None:
            self._deliver(run.callback, key, environ, answer)

    # --- async mode: background threads, status locations, callbacks ----------------------------

    def _room(self) -> bool:
        with self._lock:
            return self._busy < self.max_background

    def _submit(self, fn: Callable[..., object], *args: Any) -> bool:
        """Run ``fn(*args)`` in a background thread with this request's context (its question
        and deadline bound), if fewer than ``max_background`` are busy."""
        with self._lock:
            if self._busy >= self.max_background:
                return False
            self._busy += 1
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.max_background,
                                                thread_name_prefix="askonce-join-async")
            pool = self._pool
        context = contextvars.copy_context()

        def done(_: object) -> None:
            with self._lock:
                self._busy -= 1

        pool.submit(context.run, fn, *args).add_done_callback(done)
        return True

    def _deliver(self, url: str, key: tuple[str, str, str], environ: Environ,
                 answer: Answer | None) -> None:
        """POST ``answer`` to ``url`` from a background thread (one of ``max_background``)."""
        if self._hooks is None:
            return
        where = str(environ.get("SCRIPT_NAME", "")) + location(self.status_path, key)
        if _BACKGROUND.get():  # a background thread: it delivers, then it is free
            deliver(self._hooks, url, key[2], where, answer)
        elif not self._submit(deliver, self._hooks, url, key[2], where, answer):
            _stats.count("server.join.callback.dropped")

    def _watch(self, key: tuple[str, str, str], deadline: float | None, hook: str,
               environ: Environ) -> None:
        """Wait for a run elsewhere in the fleet and POST its answer to ``hook`` (this thread
        takes the store's waiter slot the arrival took)."""
        store = self.store
        assert store is not None
        answer = store.wait(key, wait_left(deadline), self.policy)
        where = str(environ.get("SCRIPT_NAME", "")) + location(self.status_path, key)
        if self._hooks is not None:
            deliver(self._hooks, hook, key[2], where,
                    None if answer is store.TIMED_OUT else answer)

    def _accepted(self, environ: Environ, start_response: StartResponse,
                  key: tuple[str, str, str]) -> list[bytes]:
        where = str(environ.get("SCRIPT_NAME", "")) + location(self.status_path, key)
        return _send(start_response, accepted_answer(where), None)

    def _status(self, environ: Environ, start_response: StartResponse) -> list[bytes]:
        """The status location (see ``asgi_join``): the kept answer, 202 while it runs
        (``Prefer: wait=N`` blocks this worker thread up to N seconds), 404 otherwise."""
        found = located(str(environ.get("PATH_INFO", ""))[len(self.status_path):])
        who = principal_of(self.principal, environ)
        if found is None or who is None or environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            return _send(start_response, status_answer("unknown", None, "")[0], None)
        key = (who, *found)
        wait = _prefer(environ).wait or 0.0
        if self.store is not None:
            state, kept = self.store.look(key, self.policy, wait)
        else:
            with self._lock:
                entry = self.joins.peek(key, _stats.monotonic())
            run = None if entry is None else entry.signal
            if entry is not None and not entry.done and wait and isinstance(run, Run) \
                    and isinstance(run.wake, threading.Event):
                run.wake.wait(wait)
            state, kept = ("answer", entry.answer) if entry is not None and entry.done \
                and entry.answer is not None else ("running", None) if entry is not None \
                and not entry.done else ("none", None)
        where = str(environ.get("SCRIPT_NAME", "")) + location(self.status_path, key)
        answer, replay = status_answer(state, kept, where)
        return _send(start_response, answer, "replay" if replay else None)


def _background(run: Callable[[Environ, StartResponse], Iterable[bytes]], environ: Environ,
                body: bytes) -> None:
    """Run a question in a background thread (async mode): its own environ and body, a
    ``start_response`` that sends nothing, its body read to the end and closed."""
    _stats.count("server.join.async")
    _BACKGROUND.set(True)  # in this thread's copy of the request's context only
    mine = dict(environ)
    mine["wsgi.input"] = io.BytesIO(body)

    def start_response(line: str, headers: list[tuple[str, str]], exc_info: Any = None
                       ) -> Callable[[bytes], object]:
        return lambda _: None

    try:
        result = run(mine, start_response)
        try:
            for _ in result:
                pass
        finally:
            _close(result)
    except Exception:  # the run's own failure is its answer's business: none is kept
        _stats.count("server.join.async.failed")


def _prefer(environ: Environ) -> Preference:
    return parse_prefer(_lines(environ.get("HTTP_PREFER")), MAX_LONG_POLL)


def _lines(value: object) -> list[str]:
    """A request header as WSGI gives it (its lines joined by commas), as a list of one."""
    return [value] if isinstance(value, str) and value else []



class _Streamed:
    """A response too large to keep: the chunks read so far, then the rest, closed as WSGI says."""

    __slots__ = ("_chunks", "_result")

    def __init__(self, chunks: Iterator[bytes], result: Iterable[bytes]) -> None:
        self._chunks = chunks
        self._result = result

    def __iter__(self) -> Iterator[bytes]:
        return self._chunks

    def close(self) -> None:
        _close(self._result)


def _refuse(start_response: StartResponse) -> list[bytes]:
    """A re-attach with no run to join: refused, never run (see ``asgi_join``)."""
    _stats.count("server.join.refused-rejoin")
    status, headers, body = REFUSED
    start_response(_status_line(status), list(headers))
    return [body]


def _close(result: Iterable[bytes]) -> None:
    close = getattr(result, "close", None)
    if close is not None:
        close()


def _read_body(environ: Environ, limit: int) -> bytes | None:
    """The request body when it is at most ``limit`` (``wsgi.input`` is replaced so the app reads
    it again): its declared length, or, without one, up to the end of a ``wsgi.input_terminated``
    input (waitress sets it on every request, a bodyless GET too); ``None`` otherwise: a chunked
    body on a server that does not terminate its input, one too long, or one that came short."""
    raw = environ.get("CONTENT_LENGTH")
    if not raw:
        if not environ.get("wsgi.input_terminated"):
            # No length: no body, unless one is coming in chunks, which only a terminated input
            # may be read to its end.
            return None if environ.get("HTTP_TRANSFER_ENCODING") else b""
        stream = environ.get("wsgi.input")
        if stream is None:
            return b""
        body = bytes(stream.read(limit + 1))
        if len(body) > limit:  # too large to compare: the app reads it all, as it came
            environ["wsgi.input"] = io.BufferedReader(_Prefixed(body, stream))
            return None
        environ["wsgi.input"] = io.BytesIO(body)
        return body
    try:
        length = int(raw)
    except ValueError:
        return None
    if not 0 <= length <= limit:
        return None
    if length == 0:
        return b""
    stream = environ.get("wsgi.input")
    if stream is None:
        return None
    body = bytes(stream.read(length))
    environ["wsgi.input"] = io.BytesIO(body)
    return body if len(body) == length else None


class _Prefixed(io.RawIOBase):
    """What was read of a stream, then the rest of it."""

    def __init__(self, head: bytes, rest: Any) -> None:
        self._head = memoryview(head)
        self._rest = rest

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self._head:
            n = min(len(buffer), len(self._head))
            buffer[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        data = self._rest.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)


def _wait(entry: Entry, deadline: float | None) -> Answer | None:
    run = entry.signal
    if not isinstance(run, Run) or not isinstance(run.wake, threading.Event):
        return None
    if not run.wake.wait(wait_left(deadline)):
        return Answer(503, (), b"")  # the waiter's own deadline passed
    return entry.answer


def _status_line(code: int) -> str:
    try:
        return f"{code} {HTTPStatus(code).phrase}"
    except ValueError:
        return f"{code} Status"


def _send(start_response: StartResponse, answer: Answer, how: str | None) -> list[bytes]:
    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in answer.headers]
    if how is not None:
        headers.append((_JOINED, how))
        answered_by_run()
    start_response(_status_line(answer.status), headers)
    return [answer.body]
