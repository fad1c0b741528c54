"""What the ASGI and WSGI join middlewares share: the run a waiter joins, and its account.

A waiter's own header carries what its caller still holds for the question (``b``), which is what
the run was forwarded (``Run.budget``) less the re-attaches that caller has paid since. What is
left for the question is then the run's own left less those re-attaches: the waiter's account is
lowered to it, and its ``askonce-reply`` says so.
"""

from __future__ import annotations

import enum
import hashlib
import threading
from collections.abc import Callable
from typing import Any

from askonce import _stats
from askonce._replies import recording
from askonce.core import wire
from askonce.core.join import Answer, JoinPolicy, Joins, Verdict
from askonce.core.question import Tab
from askonce.core.wire import REPLY_HEADER, Reply
from askonce.integrations._server import Arrival, note_failure

JOINED_HEADER = b"askonce-joined"
MAX_REARRIVALS = 3  # a waiter whose run was abandoned arrives again, at most this often
MAX_WAIT = 300.0  # seconds a waiter waits for a question without a deadline
CONFLICT_BODY = b"this question's key came with another request"
CONFLICT = Answer(422, ((b"content-type", b"text/plain"),), CONFLICT_BODY)
# A re-attach with no run to join (status, headers, body): what was held for the lost run is not
# this callee's to give back, so the reply says none is left.
_REFUSED_BODY = b"askonce: no run of this question to join here\n"
REFUSED = (503, (("content-type", "text/plain; charset=utf-8"),
                 ("content-length", str(len(_REFUSED_BODY))),
                 (REPLY_HEADER, wire.format_reply(Reply(0, True, "exhausted", joins=True)))),
           _REFUSED_BODY)


class Step(enum.Enum):
    """What a join middleware does with one arrival (:func:`step`)."""

    RUN = "run"  # run the handler for its caller
    LATER = "later"  # run it in the background; answer 202 (async mode)
    ACCEPT = "accept"  # another run answers it: 202 (async mode)
    WAIT = "wait"  # wait for the run in flight, answer with its answer
    REPLAY = "replay"  # answer with the kept answer
    CONFLICT = "conflict"  # 422
    PASS = "pass"  # run unjoined (a re-attach: refused)


def step(verdict: Verdict, found: bool, rejoin: bool, later: bool, room: bool) -> Step:
    """The one place a join verdict becomes an action, for every join middleware and store.

    ``found``: what the verdict needs came with it (the entry, the lease token, the kept answer);
    ``rejoin``: the arrival is a re-attach (it may join, never run); ``later``: it asked
    ``Prefer: respond-async`` and this callee may answer so; ``room``: a background slot is free.
    """
    if verdict is Verdict.CONFLICT:
        return Step.CONFLICT
    if not found or verdict is Verdict.BYPASS:
        return Step.PASS
    if verdict is Verdict.RUN:
        if rejoin:
            return Step.PASS  # nothing to join: the lost run may still be going elsewhere
        if later and not room:
            _stats.count("server.join.async.full")  # the preference is ignored
        return Step.LATER if later and room else Step.RUN
    if verdict is Verdict.WAIT:
        return Step.ACCEPT if later else Step.WAIT
    return Step.REPLAY


def wait_left(deadline: float | None) -> float:
    """Seconds a waiter may wait for a run: its question's time left, at most ``MAX_WAIT``."""
    return MAX_WAIT if deadline is None else max(0.0, min(MAX_WAIT,
                                                          deadline - _stats.monotonic()))


class Run:
    """The shell's slot on a join entry: how its waiters are woken, and the run's account."""

    __slots__ = ("budget", "callback", "noted", "owner", "tab", "wake")

    def __init__(self, owner: object, wake: object, tab: Tab) -> None:
        self.owner = owner  # the event loop (ASGI) the wake event belongs to, or None
        self.wake = wake
        self.tab = tab
        self.budget = tab.account.left  # what the run was forwarded
        self.noted: BaseException | None = None  # the give-up its error answer stands for
        self.callback: str | None = None  # where to POST its answer (async mode), if anywhere


class Joining:
    """What both join middlewares hold: the app, the policy, the principal callable, the table of
    questions and its lock. ``request``: what the principal callable is given (for messages)."""

    def __init__(self, app: Any, policy: JoinPolicy, principal: Callable[[Any], str] | None,
                 *, kind: str, request: str) -> None:
        if not callable(app):
            raise ValueError(f"app must be {kind} application, got {app!r}")
        if not isinstance(policy, JoinPolicy):
            raise ValueError(f"policy must be a JoinPolicy, got {policy!r}")
        if principal is not None and not callable(principal):
            raise ValueError(f"principal must be a callable of the {request}, got {principal!r}")
        self.app = app
        self.policy = policy
        self.principal = principal
        self.joins = Joins(policy)
        self._lock = threading.Lock()


def ran(run: object) -> None:
    """The run's handler returned: keep what its error answer stands for (a give-up below, which
    the server middleware turns into a 503 with do-not-retry), for its waiters to answer alike."""
    arrival = recording()
    if isinstance(run, Run) and isinstance(arrival, Arrival):
        run.noted = arrival.noted


def joined(waiter: Tab, run: object) -> None:
    """A waiter answers with the run's answer: its account lowered to what the run left for the
    question, and the run's give-up (if its answer was one) noted for its own reply."""
    if isinstance(run, Run):
        waiter.account.lower_to(run.tab.account.left - (run.budget - waiter.account.left))
        if run.noted is not None:
            note_failure(run.noted)


def principal_of(principal: Callable[[Any], str] | None, request: Any) -> str | None:
    """Who asks, by the application's callable; ``None`` if it raised (the request then runs
    unjoined: no answer is shared across principals on a guess)."""
    if principal is None:
        return ""
    try:
        return str(principal(request))
    except Exception:
        _stats.count("server.join.principal-error")
        return None


def announce() -> None:
    """Say in this request's ``askonce-reply`` that this layer joins (member ``j``)."""
    arrival = recording()
    if isinstance(arrival, Arrival):
        arrival.joins = True
        told = arrival.told
        if told is not None and not told.joins:
            told.joins = True  # the server's own refusals say j from now on


def answered_by_run() -> None:
    """This request started no run of its own: it got a run's answer (waited for it, or its kept
    answer), or left while waiting for one. The target's ledger counts it apart from the work
    started (``work_per_question``); once per arrival."""
    arrival = recording()
    if isinstance(arrival, Arrival) and arrival.on_joined is not None:
        note, arrival.on_joined = arrival.on_joined, None  # once per arrival
        note(arrival.joined_as, arrival.recorded_at)


def detach() -> None:
    """This request runs a question others may join: its caller going away does not cancel it
    (``AskonceASGIMiddleware``'s disconnect watch); its deadline still does."""
    arrival = recording()
    if isinstance(arrival, Arrival):
        arrival.detached = True


def digest(query: bytes, body: bytes) -> bytes:
    """What tells two requests under one key apart (the IETF Idempotency-Key draft's
    fingerprint)."""
    return hashlib.blake2b(query + b"\x00" + body, digest_size=16).digest()
