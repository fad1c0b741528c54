"""WSGI middleware: the question bound for each request, ``askonce-reply`` on every response.

::

    app.wsgi_app = AskonceWSGIMiddleware(app.wsgi_app, layer="svc")   # Flask
    application = AskonceWSGIMiddleware(get_wsgi_application(), layer="svc")   # Django (wsgi.py)

Per request it does what :mod:`._server` decides (extract or mint, ledger, shedding, the reply, 503
for a give-up). The question stays bound for the app call *and* for the iteration of the response
body (streaming views see it too): both run in one ``contextvars.Context`` made for the request.

Unlike ASGI, WSGI cannot stop a handler: an arrival already past its deadline is refused before the
app runs, but a handler that overruns its deadline runs to the end, and a client that disconnects is
not noticed. Flask answers unhandled exceptions with its own 500 inside the app; when the wrapped
app is a Flask app, the middleware listens to Flask's ``got_request_exception`` so that a give-up
still becomes a 503 with the reply (other frameworks: call :func:`note_failure` from their error
hook).
"""

from __future__ import annotations

import contextvars
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import TracebackType
from typing import Any

from askonce import _stats
from askonce.core.concurrency import ConcurrencyPolicy
from askonce.core.naming import method_name, path_template
from askonce.core.wire import REPLY_HEADER, Limits
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

__all__ = ["LEDGER_LOCK", "AskonceWSGIMiddleware", "ConcurrencyPolicy", "note_failure",
           "route_operations"]

Environ = dict[str, Any]
ExcInfo = tuple[type[BaseException], BaseException, TracebackType | None] | tuple[None, None, None]
StartResponse = Callable[..., Callable[[bytes], object]]
WSGIApp = Callable[[Environ, StartResponse], Iterable[bytes]]


class AskonceWSGIMiddleware:
    """Bind the incoming question for each request and answer for it; see the module docstring.

    Options as :class:`askonce.integrations.asgi.AskonceASGIMiddleware` (``edge_secret`` included),
    with ``principal`` and ``operation`` called on the WSGI environ. The default operation is the
    method and the Flask rule (``"GET /items/<int:item_id>"``) when the app is a Flask app, else the
    method and the path with id-like segments replaced by ``{id}``. ``concurrency``: the requests
    counted against the limit are those in the app (the server's thread pool is the queue in front
    of it; one whose deadline passed while it waited for a thread is refused before the limit), each
    from the app call until its body is closed (or read to the end).
    """

    def __init__(
        self,
        app: WSGIApp,
        *,
        layer: str,
        originator: bool = False,
        limits: Limits = Limits(),
        budget: int = 2,
        deadline: float | None = 30.0,
        ledger: LedgerLike | None = None,
        principal: Callable[[Environ], str] | None = None,
        operation: Callable[[Environ], str] | None = None,
        shed_deadline: bool = True,
        edge_secret: Secret | Sequence[Secret] | None = None,
        trust: bool | Callable[[Any], bool] | None = None,
        concurrency: ConcurrencyPolicy | None = None,
    ) -> None:
        if not callable(app):
            raise ValueError(f"app must be a WSGI application, got {app!r}")
        self.app = app
        self.server = Server(ServerOptions(
            layer=layer, originator=originator, limits=limits, budget=budget, deadline=deadline,
            ledger=ledger, principal=principal, operation=operation, shed_deadline=shed_deadline,
            edge_secret=edge_secret, trust=trust, concurrency=concurrency,
        ))  # fmt: skip
        self._flask = _flask_of(app)
        if self._flask is not None:
            _listen_to_flask(self._flask)

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        ctx = contextvars.copy_context()
        return ctx.run(self._call, ctx, environ, start_response)

    def _call(self, ctx: contextvars.Context, environ: Environ,
              start_response: StartResponse) -> Iterable[bytes]:
        value = environ.get("HTTP_ASKONCE_QUESTION")
        arrival = self.server.enter(() if value is None else (value,), environ, self.route)
        if arrival.answer is not None:
            _start(start_response, arrival.answer)
            return [arrival.answer.body]
        exchange = _Exchange(self.server, arrival, start_response)
        try:
            body = self.app(environ, exchange.start_response)
        except BaseException as exc:
            exchange.end(False)
            if not isinstance(exc, Exception):
                raise
            answer = self.server.failure(arrival, exc, count=False)
            if answer is None:
                raise
            # a second start_response must carry exc_info (PEP 3333); a first one need not, and some
            # servers re-raise whenever it is given
            _replace(self.server, start_response, answer,
                     sys.exc_info() if exchange.called else None)
            return [answer.body]
        return (_SizedBody if hasattr(body, "__len__") else _Body)(ctx, body, exchange)

    def route(self, environ: Environ) -> str:
        """The default operation name: method and Flask rule, or the path with ids as ``{id}``."""
        method = method_name(str(environ.get("REQUEST_METHOD", "GET")))
        if self._flask is not None:
            try:
                rule, _ = self._flask.url_map.bind_to_environ(environ).match(return_rule=True)
                return f"{method} {rule.rule}"
            except Exception:
                # NotFound, MethodNotAllowed, RequestRedirect: no rule serves it as sent.
                return f"{method} {UNMATCHED}"
        return path_template(method, str(environ.get("PATH_INFO", "")))


class _Exchange:
    """The app's ``start_response``, wrapped: adds the reply, or replaces a noted failure's 5xx."""

    __slots__ = ("arrival", "called", "ok", "replaced", "server", "start_response_")

    def __init__(self, server: Server, arrival: Arrival, start_response: StartResponse) -> None:
        self.server = server
        self.arrival = arrival
        self.start_response_ = start_response
        self.replaced: Answer | None = None
        self.called = False
        self.ok = False  # the app started a response below 500

    def end(self, ok: bool) -> None:
        """The request is over: its slot of the concurrency limit, if it has one, is given back."""
        if self.arrival.slot is not None:
            self.server.done(self.arrival, ok and self.ok and self.replaced is None)

    def start_response(self, status: str, headers: list[tuple[str, str]],
                       exc_info: ExcInfo | None = None) -> Callable[[bytes], object]:
        self.called = True
        arrival = self.arrival
        self.ok = status[:1] in ("1", "2", "3", "4")
        if arrival.noted is not None and status[:1] == "5":
            answer = self.server.failure(arrival, arrival.noted, count=False)
            if answer is not None:
                self.replaced = answer
                _replace(self.server, self.start_response_, answer, exc_info)
                return _discard
        if not any(name.lower() == REPLY_HEADER for name, _ in headers):
            headers = [*headers, (REPLY_HEADER, arrival.reply_header())]
        if exc_info is None:
            return self.start_response_(status, headers)
        return self.start_response_(status, headers, exc_info)


def _discard(data: bytes) -> None:
    """The ``write`` callable of a response that was replaced: the app's bytes are not sent."""


def _start(start_response: StartResponse, answer: Answer, exc_info: ExcInfo | None = None) -> None:
    if exc_info is None:
        start_response(answer.status_line, answer.headers())
    else:
        start_response(answer.status_line, answer.headers(), exc_info)


def _replace(server: Server, start_response: StartResponse, answer: Answer,
             exc_info: ExcInfo | None) -> None:
    """Start a give-up's 503 in place of the app's response.

    Counted as sent only once the server took it. A server whose headers are already out re-raises
    ``exc_info`` instead (PEP 3333): the response is then cut as it would be without the middleware,
    and counted as ``server.gave-up.unsent``.
    """
    try:
        _start(start_response, answer, exc_info)
    except BaseException:
        _stats.count("server.gave-up.unsent")
        raise
    server.count_give_up(answer)


class _Body:
    """The app's response body, iterated inside the request's context; replaced if its status was.

    A streaming app (a generator) runs at the server's first ``next``, so a give-up may escape here
    rather than from the app call: while the server has not sent the headers (PEP 3333: with the
    first non-empty chunk; wsgiref sends them with an empty one too) it is still answered with the
    503; after that the response is cut as it would be without the middleware.
    """

    __slots__ = ("_ctx", "_exchange", "_inner", "_it", "_sent", "_streamed")

    def __init__(self, ctx: contextvars.Context, inner: Iterable[bytes],
                 exchange: _Exchange) -> None:
        self._ctx = ctx
        self._inner = inner
        self._exchange = exchange
        self._it: Iterator[bytes] | None = None
        self._sent = False
        self._streamed = False  # a non-empty chunk of the app's went out: its headers are sent

    def __iter__(self) -> Iterator[bytes]:
        return self

    def __next__(self) -> bytes:
        exchange = self._exchange
        replaced = exchange.replaced
        if replaced is None:
            try:
                if self._it is None:
                    self._it = self._ctx.run(iter, self._inner)
                chunk = self._ctx.run(next, self._it)
            except StopIteration:
                exchange.end(True)
                raise
            except Exception as exc:
                exchange.end(False)
                server = exchange.server
                answer = (None if self._streamed
                          else server.failure(exchange.arrival, exc, count=False))
                if answer is None:
                    raise
                exchange.replaced = answer
                # as in _call: exc_info only for a second start_response (the server re-raises if it
                # already sent the headers, which the app may have done through write())
                _replace(server, exchange.start_response_, answer,
                         sys.exc_info() if exchange.called else None)
                self._sent = True
                return answer.body
            replaced = exchange.replaced  # start_response may be called at the first chunk
            if replaced is None:
                if chunk:
                    self._streamed = True
                return chunk
        if self._sent:
            raise StopIteration
        self._sent = True
        return replaced.body

    def close(self) -> None:
        try:
            close = getattr(self._inner, "close", None)
            if close is not None:
                self._ctx.run(close)
        finally:
            self._exchange.end(True)


class _SizedBody(_Body):
    """A body whose length the server can ask.

    PEP 3333: a one-item body lets it send a Content-Length.
    """

    __slots__ = ()

    def __len__(self) -> int:
        return (1 if self._exchange.replaced is not None
                else len(self._inner))  # type: ignore[arg-type]


# --- Flask, without importing it unless the app is one --------------------------------------------


def route_operations(app: Any) -> list[str]:
    """Every operation name the default ``operation`` gives a request to a Flask ``app`` (or its
    ``wsgi_app``): each URL rule with each of its methods (``"GET /items/<int:item_id>"``), and
    ``"GET ~unmatched"`` and the like. For an allow-list such as the Prometheus collector's
    ``operations=``; empty for another WSGI app (the names then come from the path)."""
    flask_app = _flask_of(app)
    if flask_app is None:
        return []
    names = {f"{m} {UNMATCHED}" for m in METHODS}
    for rule in flask_app.url_map.iter_rules():
        names.update(f"{m} {rule.rule}" for m in rule.methods or METHODS)
    return sorted(names)


def _flask_of(app: Any) -> Any:
    owner = getattr(app, "__self__", app)  # app.wsgi_app is a bound method of the Flask app
    if type(owner).__module__.split(".")[0] == "flask" or (
        hasattr(owner, "url_map") and hasattr(owner, "handle_exception")
    ):
        return owner
    return None


def _flask_noted(sender: Any, **extra: Any) -> None:
    exc = extra.get("exception")
    if isinstance(exc, BaseException):
        note_failure(exc)


def _listen_to_flask(app: Any) -> None:
    try:
        from flask.signals import got_request_exception
    except ImportError:  # something Flask-like that is not Flask: no signal to listen to
        return
    # Once per app: blinker dedupes.
    got_request_exception.connect(_flask_noted, sender=app, weak=False)
