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
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable, Iterable, Iterator
from http import HTTPStatus
from itertools import chain
from typing import TYPE_CHECKING, Any

from askonce import _stats
from askonce._context import current_frame
from askonce.core.join import Answer, Entry, JoinPolicy, Verdict
from askonce.core.question import Tab
from askonce.core.wire import is_rejoin
from askonce.integrations._join import (
    CONFLICT_BODY,
    JOINED_HEADER,
    MAX_REARRIVALS,
    MAX_WAIT,
    REFUSED,
    Joining,
    Run,
    announce,
    answered_by_run,
    digest,
    joined,
    principal_of,
    ran,
)
from askonce.integrations.wsgi import Environ, StartResponse, WSGIApp

if TYPE_CHECKING:
    from askonce.stores.join_redis import RedisJoinStore

__all__ = ["JoinWSGIMiddleware"]

_JOINED = JOINED_HEADER.decode("ascii")


class JoinWSGIMiddleware(Joining):
    """See the module docstring. ``principal(environ) -> str``: who asks (after your
    authentication); an answer is never replayed to another principal."""

    app: WSGIApp

    def __init__(self, app: WSGIApp, *, policy: JoinPolicy = JoinPolicy(),
                 principal: Callable[[Environ], str] | None = None,
                 store: RedisJoinStore | None = None) -> None:
        super().__init__(app, policy, principal, kind="a WSGI", request="environ")
        if store is not None and not callable(getattr(store, "arrive", None)):
            raise ValueError(f"store must be a RedisJoinStore, got {store!r}")
        self.store = store

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
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
        if self.store is not None:
            return self._shared(key, fingerprint, rejoin, tab, environ, start_response)
        for _ in range(MAX_REARRIVALS):
            with self._lock:
                verdict, entry = self.joins.arrive(key, fingerprint, _stats.monotonic())
                if verdict is Verdict.RUN and entry is not None:
                    if rejoin:  # nothing to join: the lost run may still be going elsewhere
                        self.joins.abandon(key, entry)
                    else:
                        entry.signal = Run(None, threading.Event(), tab)
            _stats.count(f"server.join.{verdict.value}")
            if verdict is Verdict.RUN and entry is not None and not rejoin:
                return self._run(key, entry, environ, start_response)
            if verdict is Verdict.WAIT and entry is not None:
                answer = _wait(entry, tab.deadline)
                if answer is None:
                    continue  # the run ended without an answer: arrive again
                joined(tab, entry.signal)
                return _send(start_response, answer, "wait")
            if verdict is Verdict.REPLAY and entry is not None and entry.answer is not None:
                joined(tab, entry.signal)
                return _send(start_response, entry.answer, "replay")
            if verdict is Verdict.CONFLICT:
                return _send(start_response,
                             Answer(422, ((b"content-type", b"text/plain"),), CONFLICT_BODY), None)
            break  # BYPASS, or RUN for a re-attach
        return _refuse(start_response) if rejoin else self.app(environ, start_response)

    def _shared(self, key: tuple[str, str, str], fingerprint: bytes, rejoin: bool, tab: Tab,
                environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        """The same decisions, in the fleet's Redis store (``askonce.stores.join_redis``)."""
        store = self.store
        assert store is not None
        for _ in range(MAX_REARRIVALS):
            verdict, answer, token = store.arrive(key, fingerprint, self.policy,
                                                  may_run=not rejoin)
            _stats.count(f"server.join.{verdict.value}")
            if verdict is Verdict.RUN and token is not None:
                def finish(answer: Answer | None, token: bytes = token) -> None:
                    store.finish(key, token, answer, self.policy)

                return self._run(key, None, environ, start_response, finish)
            if verdict is Verdict.WAIT:
                left = MAX_WAIT if tab.deadline is None else max(
                    0.0, min(MAX_WAIT, tab.deadline - _stats.monotonic()))
                answer = store.wait(key, left, self.policy)
                if answer is None:
                    continue  # the run ended without an answer, or its holder died
                return _send(start_response, answer, "wait")
            if verdict is Verdict.REPLAY and answer is not None:
                return _send(start_response, answer, "replay")
            if verdict is Verdict.CONFLICT:
                return _send(start_response,
                             Answer(422, ((b"content-type", b"text/plain"),), CONFLICT_BODY), None)
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
                self._settle(key, entry, answer)

    def _settle(self, key: tuple[str, str, str], entry: Entry, answer: Answer | None) -> None:
        ran(entry.signal)
        with self._lock:
            if answer is None:
                self.joins.abandon(key, entry)
            else:
                self.joins.finish(key, entry, answer, _stats.monotonic())
        run = entry.signal
        if isinstance(run, Run) and isinstance(run.wake, threading.Event):
            run.wake.set()


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
    """The request body when its length is declared and at most ``limit`` (``wsgi.input`` is
    replaced so the app reads it again); ``None`` otherwise: a body of undeclared length (chunked),
    one too long, or one that came short."""
    raw = environ.get("CONTENT_LENGTH")
    if not raw:
        # No length: no body, unless one is coming in chunks.
        chunked = environ.get("HTTP_TRANSFER_ENCODING") or environ.get("wsgi.input_terminated")
        return None if chunked else b""
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


def _wait(entry: Entry, deadline: float | None) -> Answer | None:
    run = entry.signal
    if not isinstance(run, Run) or not isinstance(run.wake, threading.Event):
        return None
    left = MAX_WAIT if deadline is None else max(0.0, deadline - _stats.monotonic())
    if not run.wake.wait(min(left, MAX_WAIT)):
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
