"""What every server integration does with one request, free of any framework.

The ASGI, WSGI (and gRPC) middlewares only move bytes; this module decides. For one arrival:

1. ``propagation.serve`` extracts the question (clamped to the layer's limits) or mints one, and
   binds it; a header that was sent but could not be used is *malformed* (``propagation.extract``
   counts it);
2. the ledger, if one is wired, records the arrival (wall-clock seconds, the operation's route
   template, the principal); over the cap, the request is answered 429 with ``dnr`` reason ``cap``;
3. a propagated deadline that has already passed is answered 503 with ``dnr`` reason ``deadline``;
4. with a ``concurrency`` policy, a request over the adaptive limit (``core.concurrency``) is
   answered 503 at once with ``dnr`` reason ``overloaded``, the policy's pushback and
   ``Retry-After``; the shell calls :meth:`Server.done` when a request that got a slot ends, with
   whether it went well, and the time it took is the limiter's latency sample;
5. otherwise the app runs; its response carries ``askonce-reply`` (what is left of the budget), and
   a give-up that escapes it (``askonce.GaveUp``, or any exception carrying ``askonce_reply``) is
   answered 503 with the reply and ``Retry-After`` from the pushback.

Frameworks that turn exceptions into their own 500 inside the app (Flask, Django) hide the give-up
from the middleware; their error hook calls :func:`note_failure`, and a 5xx the app then sends is
replaced by the same 503. The request also runs inside :func:`askonce.client.replies`, so a handler
that turns a downstream give-up *response* into an error of its own
(``return Response(status_code=502)``) is caught the same way: when the app answers 5xx and the
latest outgoing call that gave up said do-not-retry, the answer carries that do-not-retry
(``Reply(min(left, r.budget), True, r.reason, r.pushback)``, the rule of
``propagation.Serving.reply``).
A handler that answers 2xx-4xx after a give-up keeps its answer, without it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, Protocol, cast

from askonce import _context, _stats, propagation
from askonce._context import FRAME
from askonce._replies import RECORD as _give_ups  # the context variable of replies()
from askonce._replies import Record, recording
from askonce.core import is_int, is_real, wire
from askonce.core.concurrency import TAKEN, TOO_LATE, ConcurrencyPolicy, Limiter
from askonce.core.naming import MAX_OPERATION_CHARS
from askonce.core.question import Frame, Tab
from askonce.core.wire import REPLY_HEADER, Limits, Reply
from askonce.errors import reply_of
from askonce.propagation import Serving

UNMATCHED = "~unmatched"
UNKNOWN = "~unknown"
# The methods an operation allow-list names for a route that takes any, and for ``~unmatched``.
METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")

UNSIGNED = "~unsigned"

# The core ledger is not thread-safe; every server integration in the process records under this
# lock. Code that reads reports from the same ledger while requests are served takes it too. A
# ledger that says ``thread_safe = True`` (the shells in ``askonce.ledger.store``) is called without
# it: it has locks of its own, and a Redis ledger's record may wait on a round trip that must not
# hold up every other request of the process.
LEDGER_LOCK = threading.Lock()

Secret = bytes | str


class LedgerLike(Protocol):
    """What a server integration needs of a ledger: :meth:`askonce.core.ledger.Ledger.record`."""

    def record(self, now: float, operation: str, *, key: str | None, edge: bool = False,
               origin: str | None = None, path: tuple[tuple[str, int], ...] = (),
               principal: str = "", malformed: bool = False) -> bool: ...


@dataclass(frozen=True, slots=True)
class ServerOptions:
    """A server layer's configuration, shared by the ASGI, WSGI and gRPC integrations.

    ``budget``/``deadline`` apply only to questions this layer mints (nothing usable arrived);
    ``originator=True`` mints attributable edge keys, otherwise local keys. ``principal`` and
    ``operation`` are called with the framework's request object (ASGI scope, WSGI environ, ...).
    ``edge_secret``: the originators' shared secret (or several, newest first, while rotating): an
    arrival that says ``e`` without a signature that verifies (``core.signing``) is recorded by
    the ledger as not attributable, re-minted by origin ``"~unsigned"``, and counted as
    ``ledger.edge.unsigned``; an originator layer signs the keys it mints with the first secret.
    ``trust``: whether a question that arrives is believed as sent. ``None`` (the default): trusted
    unless this layer is an originator (a public edge); or ``True``, ``False``, or a callable of
    the request (after your authentication: by network, by a verified signature). An untrusted
    question keeps its key (so the ledger still counts per question) but is adopted as this
    layer's own: its budget at most ``budget``, its deadline at most ``deadline`` (and
    ``deadline`` when it sent none), its path restarted (counted ``server.untrusted``); at an
    originator its edge flag and signature are this layer's, elsewhere the edge flag is kept
    only with a signature (which a ledger with ``edge_secret`` verifies). A ``trust`` callable
    that raises means untrusted (counted ``server.trust.error``). ``concurrency``: an adaptive
    limit on the requests in the app (off by default: what it refuses is a 503 the service did
    not give before, and its headroom is best set knowing the service's workers).
    """

    layer: str
    originator: bool = False
    limits: Limits = Limits()
    budget: int = 2
    deadline: float | None = 30.0
    ledger: LedgerLike | None = None
    principal: Callable[[Any], str] | None = None
    operation: Callable[[Any], str] | None = None
    shed_deadline: bool = True
    edge_secret: Secret | Sequence[Secret] | None = None
    trust: bool | Callable[[Any], bool] | None = None
    concurrency: ConcurrencyPolicy | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.layer, str) or not wire.valid_name(self.layer):
            raise ValueError(f"layer must be a name like 'api' or 'billing', got {self.layer!r}")
        for name in ("originator", "shed_deadline"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.limits, Limits):
            raise ValueError(f"limits must be an askonce.Limits, got {self.limits!r}")
        if not is_int(self.budget) or not 0 <= self.budget <= wire.MAX_BUDGET:
            raise ValueError(f"budget must be an integer within 0..{wire.MAX_BUDGET}, "
                             f"got {self.budget!r}")
        d = self.deadline
        if d is not None and (not is_real(d)
                              or not 0 < d <= wire.MAX_DEADLINE_MS / 1000):
            raise ValueError(f"deadline must be seconds within (0, 86400] or None, got {d!r}")
        if self.ledger is not None and not callable(getattr(self.ledger, "record", None)):
            raise ValueError("ledger must have a record(now, operation, *, key, ...) method "
                             "(askonce Ledger)")
        if self.concurrency is not None and not isinstance(self.concurrency, ConcurrencyPolicy):
            raise ValueError("concurrency must be an askonce.core.concurrency.ConcurrencyPolicy or "
                             f"None, got {self.concurrency!r}")
        if self.trust is not None and not isinstance(self.trust, bool) and not callable(self.trust):
            raise ValueError(f"trust must be True, False, None or a callable taking the request, "
                             f"got {self.trust!r}")
        distrusts = self.trust is False or callable(self.trust) or (
            self.trust is None and self.originator)
        cap = getattr(getattr(self.ledger, "policy", None), "cap", None)
        if distrusts and cap is not None and self.principal is None:
            # Keys come from the callers here: one who learns another's key could get that
            # question refused, unless per-key state is scoped by who asks.
            raise ValueError("a ledger cap at a layer that does not trust every caller needs a "
                             "principal callable: per-key counts must be scoped by who asks")
        for name in ("principal", "operation"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise ValueError(f"{name} must be a callable taking the request, got {value!r}")
        secret = self.edge_secret
        if secret is not None:
            if not isinstance(secret, str | bytes):
                if not isinstance(secret, Sequence):
                    raise ValueError("edge_secret must be bytes, str or a sequence of them, "
                                     f"got {secret!r}")
                secret = tuple(cast(Sequence[Secret], secret))
                object.__setattr__(self, "edge_secret", secret)
            from askonce.core.signing import verify_key  # hmac loads only when keys are signed

            try:
                # Refuses a secret that is too short, or an empty sequence.
                verify_key("", None, secret)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"edge_secret: {exc}") from None


class Answer(NamedTuple):
    """A response the middleware sends itself instead of (or in place of) the app's."""

    status: int
    reply: Reply
    retry_after: int | None = None

    @property
    def status_line(self) -> str:
        return (f"{self.status} "
                f"{'Too Many Requests' if self.status == 429 else 'Service Unavailable'}")

    @property
    def body(self) -> bytes:
        return f"askonce: {self.reply.reason or 'gave up'}\n".encode("ascii", "replace")

    def headers(self) -> list[tuple[str, str]]:
        out = [("content-type", "text/plain; charset=utf-8"),
               ("content-length", str(len(self.body))),
               (REPLY_HEADER, wire.format_reply(self.reply))]
        if self.retry_after is not None:
            out.append(("retry-after", str(self.retry_after)))
        return out


class PassedOn(Exception):
    """A do-not-retry give-up of a call the app made, recorded by :func:`askonce.client.replies`.

    The failure an error answer of the app stands for when no exception reached the middleware: the
    app turned the give-up's response into an error response of its own.
    """

    def __init__(self, reply: Reply) -> None:
        super().__init__(f"a call this request made gave up ({reply.reason or 'do not retry'})")
        self.askonce_reply = reply


class Joined:
    """Whether a join layer inside this server has announced itself (``_join.announce``): from
    then on the server's own refusals before its app runs (its ledger's cap, a deadline already
    past, its concurrency limit) say ``j`` too, so that a caller does not forget that this callee
    joins for a reply its join layer never saw. Set once, never unset (a server's middleware
    stack does not change while it runs)."""

    __slots__ = ("joins",)

    def __init__(self) -> None:
        self.joins = False


class Arrival(Record):
    """One request at this layer: the bound question, how it came, what was decided before the app.

    It is also where the give-ups of the calls the app makes are recorded
    (``askonce.client.replies``): one context variable for both, set once per request.
    """

    __slots__ = ("_noted", "_tokens", "answer", "deadline", "detached", "joined_as", "joins",
                 "malformed", "on_joined", "recorded_at", "serving", "slot", "told")

    def __init__(self, serving: Serving, malformed: bool, told: Joined | None = None) -> None:
        self.last = None
        self._tokens: tuple[Any, ...] = ()
        self.serving = serving
        self.malformed = malformed
        # Only a propagated deadline bounds the handler; a minted one bounds retries.
        self.deadline = None if serving.minted else serving.tab.deadline
        self.answer: Answer | None = None
        self._noted: BaseException | None = None
        self.joins = False  # a join middleware inside answers for this question (reply ``j``)
        self.told = told  # the server's own record that a join layer is inside
        self.detached = False  # others may join this run: a disconnect does not cancel it
        self.slot: float | None = None  # when it took a slot of the concurrency limit
        # Tells the ledger that this counted arrival (of operation ``joined_as``, recorded at
        # ``recorded_at``) was answered by a run it did not start: the server's ``joined``, set
        # when the ledger counted it.
        self.on_joined: Callable[[str, float], None] | None = None
        self.joined_as = ""
        self.recorded_at = 0.0

    @property
    def noted(self) -> BaseException | None:
        """What an error answer of the app (5xx, a gRPC error status) answers for, if anything does.

        The exception the framework's error hook noted (:func:`note_failure`), else the do-not-retry
        give-up of the latest call the app made (:func:`askonce.client.last_reply`), else ``None``.
        Read only for error answers: a good answer after a give-up keeps a plain reply.
        """
        if self._noted is not None:
            return self._noted
        passed = self.last
        return PassedOn(passed) if passed is not None and passed.dnr else None

    def reply(self, failed: bool = False) -> Reply:
        """The reply for an answer the app gave itself; ``failed``: that answer is an error. It
        says ``j`` when a join layer inside answers for this question."""
        reply = self.serving.reply(self.noted if failed else self._noted)
        return replace(reply, joins=True) if self.joins else reply

    def reply_header(self) -> str:
        if self._noted is None:
            left = self.serving.tab.account.left
            if 0 <= left < len(_PLAIN_REPLIES[0]):
                # Every response carries one: skip formatting the usual ones.
                return _PLAIN_REPLIES[self.joins][left]
        if self.joins:
            return wire.format_reply(replace(self.serving.reply(self._noted), joins=True))
        return self.serving.reply_header(self._noted)

    def reply_bytes(self) -> bytes:
        """:meth:`reply_header`, encoded for a header list of bytes (ASGI)."""
        if self._noted is None:
            left = self.serving.tab.account.left
            if 0 <= left < len(_PLAIN_REPLIES[0]):
                return _PLAIN_REPLY_BYTES[self.joins][left]
        return self.reply_header().encode("ascii")


# The usual replies, written once: [joins][budget left].
_PLAIN_REPLIES = tuple(tuple(wire.format_reply(Reply(left, joins=joins)) for left in range(65))
                       for joins in (False, True))
_PLAIN_REPLY_BYTES = tuple(tuple(reply.encode("ascii") for reply in replies)
                           for replies in _PLAIN_REPLIES)


def note_failure(exc: BaseException) -> None:
    """Tell the server middleware that the app failed with ``exc`` although it answers on its own.

    For frameworks that convert exceptions into their own error response inside the app (Flask's
    ``got_request_exception``, Django's signal of the same name). Outside a request: does nothing.
    """
    arrival = recording()
    if isinstance(arrival, Arrival) and arrival._noted is None:
        arrival._noted = exc


class _Values:
    """The question header's raw values as ``propagation.extract`` reads them.

    Duplicates are malformed.
    """

    __slots__ = ("values",)

    def __init__(self, values: Sequence[str | bytes]) -> None:
        self.values = values

    def get_all(self, name: str) -> Sequence[str | bytes]:
        return self.values


class Server:
    """The framework-free half of a server middleware; see the module docstring."""

    __slots__ = ("_joined", "_limiter", "_limiter_lock", "_lock", "_mint_secret", "_told",
                 "_trust_all", "_verify", "options")

    def __init__(self, options: ServerOptions) -> None:
        self.options = options
        ledger = options.ledger
        self._lock = (None if ledger is None or getattr(ledger, "thread_safe", False) is True
                      else LEDGER_LOCK)
        # One limiter per middleware; threads (WSGI) and event loops share it under the lock.
        self._limiter = None if options.concurrency is None else Limiter(options.concurrency)
        self._limiter_lock = threading.Lock()
        self._joined = self.joined  # bound once: every attributable arrival carries it
        self._told = Joined()
        # Every question that arrives is believed as sent: _trusted need not be asked.
        self._trust_all = options.trust is True or (options.trust is None
                                                    and not options.originator)
        secret = options.edge_secret
        self._mint_secret: Secret | None = None
        self._verify: Callable[[str, bytes | None], bool] | None = None
        if secret is not None:
            from askonce.core.signing import verify_key

            first = secret if isinstance(secret, str | bytes) else secret[0]
            self._mint_secret = first if options.originator else None
            self._verify = lambda key, sig: verify_key(key, sig, secret)

    def open(self, values: Sequence[str | bytes], request: Any,
             route: Callable[[Any], str]) -> Arrival:
        """Extract or mint and bind the question; decide whether the app may run.

        :meth:`close` unbinds. What :meth:`arrive` does, without a generator:
        ``askonce.client.replies()`` and ``propagation.serve()`` spelled out, because this runs
        for every request, where generator-based context managers are comparatively slow. The
        arrival itself is the record of the app's give-ups.
        """
        o = self.options
        now = _stats.monotonic()
        frame: Frame | None = None
        if len(values) == 1:  # propagation.extract, spelled out for the usual case, into a Tab
            parsed = wire.parse_frame(values[0], now, o.limits)
            if type(parsed) is tuple:
                frame = parsed
            else:
                _stats.count(f"malformed.question.{cast(wire.Malformed, parsed).reason}")
        elif values:
            # Duplicates: malformed, counted there.
            q = propagation.extract(_Values(values), limits=o.limits, now=now)
            if q is not None:
                frame = (propagation.tab_from(q), q.path)
        minted = frame is None
        if frame is not None and not self._trust_all and not self._trusted(request):
            frame = self._adopt(frame[0], now)
        if frame is not None:
            tab = frame[0]
        else:
            # As propagation.serve mints: a local key, or a (signed) edge key at an originator;
            # lazily.
            tab = propagation.minted_tab(o.layer, o.originator, o.budget, o.deadline, o.limits, now,
                                     self._mint_secret)
            frame = (tab, ())
        arrival = Arrival(Serving(tab, minted), bool(values) and minted, self._told)
        # client.record_replies(arrival)
        arrival._tokens = (FRAME.set(frame), _give_ups.set(arrival))
        try:
            if o.ledger is not None and not self._record(arrival, request, route):
                _stats.count("server.refused.cap")
                arrival.answer = Answer(429, Reply(tab.account.left, True, "cap",
                                                   joins=self._told.joins))
            elif (o.shed_deadline and arrival.deadline is not None
                  and arrival.deadline <= _stats.monotonic()):
                _stats.count("server.shed.deadline")
                arrival.answer = self.deadline_answer(arrival)
            elif self._limiter is not None:
                self._acquire(arrival)
        except BaseException:
            self.close(arrival)
            raise
        return arrival

    def _acquire(self, arrival: Arrival) -> None:
        limiter = self._limiter
        assert limiter is not None
        now = _stats.monotonic()
        deadline = arrival.deadline if self.options.shed_deadline else None
        with self._limiter_lock:
            entered = limiter.enter(now, deadline)
        if entered == TAKEN:
            arrival.slot = now
            return
        if entered == TOO_LATE:  # its caller stops waiting before the fastest recent answer
            _stats.count("server.shed.too-late")
            arrival.answer = self.deadline_answer(arrival)
            return
        _stats.count("server.shed.overloaded")
        pushback = limiter.policy.pushback
        ms = wire.to_ms(pushback, up=True)
        arrival.answer = Answer(503, Reply(arrival.serving.tab.account.left, True, "overloaded",
                                           ms / 1000, self._told.joins), -(-ms // 1000))

    def done(self, arrival: Arrival, ok: bool) -> None:
        """A request that took a slot of the concurrency limit has ended (once; later calls do
        nothing). ``ok``: it answered below 500, without an error or a cancellation."""
        start = arrival.slot
        if start is None or self._limiter is None:
            return
        arrival.slot = None
        now = _stats.monotonic()
        with self._limiter_lock:
            self._limiter.release(now, now - start, ok)

    @property
    def limiter(self) -> Limiter | None:
        """The concurrency limit's state (read it under no lock: a snapshot for metrics)."""
        return self._limiter

    def _trusted(self, request: Any) -> bool:
        trust = self.options.trust
        if trust is None:
            return not self.options.originator
        if trust is True or trust is False:
            return trust
        try:
            return trust(request) is True
        except Exception:
            _stats.count("server.trust.error")
            return False

    def _adopt(self, arrived: Tab, now: float) -> Frame:
        """An untrusted question as this layer's own: the key kept, the rest this layer's."""
        o = self.options
        _stats.count("server.untrusted")
        if o.originator:  # minted here as if nothing had arrived, with the caller's key
            tab = propagation.minted_tab(o.layer, True, min(arrived.account.left, o.budget),
                                         o.deadline, o.limits, now, self._mint_secret,
                                         key=arrived.key)
        else:  # the edge flag only with a signature (a ledger with edge_secret verifies it)
            tab = propagation.minted_tab(arrived.origin, arrived.edge and arrived.sig is not None,
                                         min(arrived.account.left, o.budget), o.deadline,
                                         o.limits, now, key=arrived.key)
            tab.sig = arrived.sig
        if arrived.deadline is not None:
            tab.deadline = (arrived.deadline if tab.deadline is None
                            else min(tab.deadline, arrived.deadline))
        return (tab, ())

    def close(self, arrival: Arrival) -> None:
        """Unbind what :meth:`open` bound (in the same context)."""
        frame, record = arrival._tokens
        _give_ups.reset(record)  # client.stop_recording
        FRAME.reset(frame)

    @contextmanager
    def arrive(self, values: Sequence[str | bytes], request: Any,
               route: Callable[[Any], str]) -> Iterator[Arrival]:
        """Extract or mint and bind the question for the block; decide whether the app may run.

        ``values``: the raw ``askonce-question`` header values; ``route``: the operation name when
        no ``operation`` callable is configured (called only when a ledger is wired).
        """
        arrival = self.open(values, request, route)
        try:
            yield arrival
        finally:
            self.close(arrival)

    def enter(self, values: Sequence[str | bytes], request: Any,
              route: Callable[[Any], str]) -> Arrival:
        """:meth:`open` for a caller that runs each request in a ``contextvars.Context`` of its own.

        The question stays bound in the current context with nothing to unwind: the context is
        thrown away with the request. (A binding held open across calls would be unwound by the
        garbage collector, in whatever context it runs, if a server forgot to close the response.)
        """
        arrival = self.open(values, request, route)
        # Nothing to reset; and a token refers to the context, which refers to the arrival.
        arrival._tokens = ()
        return arrival

    def _record(self, arrival: Arrival, request: Any, route: Callable[[Any], str]) -> bool:
        o = self.options
        ledger = o.ledger
        assert ledger is not None
        operation = _call(o.operation or route, request, "operation")
        principal = "" if o.principal is None else _call(o.principal, request, "principal")
        tab = arrival.serving.tab
        frame = _context.current_frame()
        now = time.time()  # the ledger's windows are on the wall clock, shared by replicas
        lock = self._lock
        try:
            if arrival.serving.minted or frame is None:
                # nothing usable came: the arrival is unkeyed (or malformed), whatever we minted
                if lock is None:
                    return ledger.record(now, operation, key=None, principal=principal,
                                         malformed=arrival.malformed)
                with lock:
                    return ledger.record(now, operation, key=None, principal=principal,
                                         malformed=arrival.malformed)
            edge, origin = tab.edge, tab.origin
            if edge and self._verify is not None and not self._verify(tab.key, tab.sig):
                _stats.count("ledger.edge.unsigned")
                edge, origin = False, UNSIGNED
            if edge:
                arrival.on_joined, arrival.joined_as = self._joined, operation
                arrival.recorded_at = now
            if lock is None:
                return ledger.record(now, operation, key=tab.key, edge=edge, origin=origin,
                                     path=frame[1], principal=principal)
            with lock:
                return ledger.record(now, operation, key=tab.key, edge=edge, origin=origin,
                                     path=frame[1], principal=principal)
        except Exception:  # a failing ledger must never fail the request: let it through, visibly
            _stats.count("server.ledger.error")
            return True

    def joined(self, operation: str, at: float) -> None:
        """Tell the ledger that an attributable arrival of ``operation``, recorded at ``at``, was
        answered by a run it did not start (``Ledger.joined``: counted in the arrival's window); a
        ledger without it counts ``server.ledger.joined-unsupported`` instead."""
        joined, lock = getattr(self.options.ledger, "joined", None), self._lock
        if joined is None:
            _stats.count("server.ledger.joined-unsupported")
            return
        try:
            if lock is None:
                joined(at, operation, edge=True)
            else:
                with lock:
                    joined(at, operation, edge=True)
        except Exception:
            _stats.count("server.ledger.error")

    def deadline_answer(self, arrival: Arrival) -> Answer:
        """The 503 at the question's deadline; it says ``j`` when a join layer inside took the
        question, or has taken one before (its caller must not forget that this callee joins)."""
        return Answer(503, Reply(arrival.serving.tab.account.left, True, "deadline",
                                 joins=arrival.joins or self._told.joins))

    def failure(self, arrival: Arrival, exc: BaseException, *, count: bool = True) -> Answer | None:
        """The 503 for a give-up that escaped the app (or was noted), or ``None`` for other errors.

        ``count=False``: the caller counts it (:meth:`count_give_up`) once the answer has really
        gone out.
        """
        exc = _single(exc)
        if reply_of(exc) is None:
            return None
        reply = arrival.serving.reply(exc)
        if arrival.joins:
            reply = replace(reply, joins=True)
        retry_after = None
        if reply.pushback is not None:
            # The app chose the pushback (inf, NaN, 1e12 alike): clamped into the protocol's
            # 0..86400 s (NaN as 0) as the reply header writes it, and Retry-After is that many ms
            # rounded up.
            ms = wire.to_ms(reply.pushback, up=True)
            reply = replace(reply, pushback=ms / 1000)
            retry_after = -(-ms // 1000)
        answer = Answer(503, reply, retry_after)
        if count:
            self.count_give_up(answer)
        return answer

    @staticmethod
    def count_give_up(answer: Answer) -> None:
        # A reason is any token a callee sent: only the known ones get a counter of their own.
        reason = answer.reply.reason
        _stats.count(f"server.gave-up.{reason if reason in wire.REASONS else 'other'}")


def _single(exc: BaseException) -> BaseException:
    # A task group wraps one failing call's error; a group of several says nothing about one reply.
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _call(fn: Callable[[Any], str], request: Any, what: str) -> str:
    # A principal or operation that cannot be told is recorded under its own name, never under a
    # real tenant's, so it can neither hide in nor be refused for another principal's key.
    try:
        value = fn(request)
    except Exception:
        _stats.count(f"server.{what}.error")
        return UNKNOWN
    if not isinstance(value, str):
        _stats.count(f"server.{what}.error")
        return UNKNOWN
    return value[:MAX_OPERATION_CHARS]
