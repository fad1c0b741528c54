"""The retry state machine: given a failure, the clock and a random draw, decide what happens next.

The shells (``askonce.retrying``, the integrations, the simulator) run a loop of three steps and
keep no decision of their own::

    state = RetryState(policy, tab, layer)
    action = state.start(now)                 # Attempt | GiveUp
    ...the attempt fails...
    action = state.on_failure(failure, now, u)  # Wait | Acquire | GiveUp
    ...on Acquire: take a token from the bucket (I/O), action = state.acquired(ok, now)...
    ...on Wait: sleep action.seconds (never when it is 0)...
    action = state.resume(now)                # Attempt | GiveUp

``on_failure`` enforces, in this order:

1. what is safe to retry: the failure must be retryable, and a non-idempotent request that may have
   reached the callee is never retried;
2. the account: what was held for a call to another process is settled (``settle``): a reply
   returns what the callee left; a failure with *no* response after the request was sent (read
   timeout, reset) counts as if the callee spent all it was forwarded (fail closed), unless the
   request provably never reached it (refused, connect timeout); then the budget must hold one
   more retry;
3. the deadline: no retry that cannot start (and run ``min_attempt``) before it;
4. the callee's do-not-retry flag, which is passed on upward;
5. pushback and Retry-After, which lengthen the wait (and beyond ``max_pushback`` end the question);
6. the layer's own attempt limit;
7. the per-client token bucket (``Acquire``: the shell takes the token, wherever the bucket lives);
8. backoff with full jitter.

A retry spends one from the shared account at once, so a sibling call of the same question sees the
lower budget before this layer even sleeps.
"""

from __future__ import annotations

from enum import StrEnum
from typing import NamedTuple

from askonce.core import is_int, is_real
from askonce.core.backoff import Backoff
from askonce.core.question import Account, Hop, Tab
from askonce.core.record import Record
from askonce.core.wire import MAX_ATTEMPT, Reply


class RetryPolicy(Record):
    """One layer's retry rules; ``budget`` and ``deadline`` apply only to questions it mints.

    ``one_layer`` (on by default): a layer that retried and then reached its own attempt limit
    tells its caller not to retry (``dnr``, reason ``retried``), so that only the layer nearest the
    failure retries, whatever budget the question has left; off, the layers above may spend it.
    """

    __slots__ = __match_args__ = ("attempts", "backoff", "budget", "deadline", "idempotent",
                                  "min_attempt", "max_pushback", "one_layer")
    attempts: int
    backoff: Backoff
    budget: int
    deadline: float | None
    idempotent: bool
    min_attempt: float
    max_pushback: float
    one_layer: bool

    def __init__(self, attempts: int = 3, backoff: Backoff = Backoff(), budget: int = 2,
                 deadline: float | None = 30.0, idempotent: bool = True, min_attempt: float = 0.0,
                 max_pushback: float = 60.0, one_layer: bool = True) -> None:
        _set = object.__setattr__
        _set(self, "attempts", attempts)
        _set(self, "backoff", backoff)
        _set(self, "budget", budget)
        _set(self, "deadline", deadline)
        _set(self, "idempotent", idempotent)
        _set(self, "min_attempt", min_attempt)
        _set(self, "max_pushback", max_pushback)
        _set(self, "one_layer", one_layer)
        self.__post_init__()

    def __post_init__(self) -> None:
        # An int: not a bool, float or str.
        if not is_int(self.attempts) or not 1 <= self.attempts <= MAX_ATTEMPT:
            raise ValueError(f"attempts must be an integer within 1..{MAX_ATTEMPT}, "
                             f"got {self.attempts!r}")
        if not is_int(self.budget) or not 0 <= self.budget <= 1000:
            raise ValueError(f"budget must be an integer within 0..1000, got {self.budget!r}")
        if not isinstance(self.backoff, Backoff):
            raise ValueError(f"backoff must be an askonce.Backoff, got {self.backoff!r}")
        # "no" is truthy: every call would be retried as safe
        if not isinstance(self.idempotent, bool):
            raise ValueError(f"idempotent must be True or False, got {self.idempotent!r}")
        if self.deadline is not None and not (is_real(self.deadline)
                                              and 0 < self.deadline <= 86_400):
            raise ValueError(f"deadline must be within (0, 86400] s or None, got {self.deadline!r}")
        if not (is_real(self.min_attempt) and 0 <= self.min_attempt <= 3600):
            raise ValueError(f"min_attempt must be within 0..3600 s, got {self.min_attempt!r}")
        if self.deadline is not None and self.min_attempt >= self.deadline:
            raise ValueError("min_attempt must be shorter than the deadline, "
                             "or no attempt could ever start")
        if not (is_real(self.max_pushback) and 0 <= self.max_pushback <= 86_400):
            raise ValueError(f"max_pushback must be within 0..86400 s, got {self.max_pushback!r}")
        if not isinstance(self.one_layer, bool):
            raise ValueError(f"one_layer must be True or False, got {self.one_layer!r}")


LOCAL = "local"  # an in-process call: the callee spends from the same account, nothing to infer
REFUSED = "refused"  # provably never reached the callee (connection refused, connect timeout)
ANSWERED = "answered"  # a response came back (with or without an askonce-reply)
LOST = "lost"  # sent, and no response: the callee may have worked and spent (read timeout, reset)
DELIVERIES = frozenset({LOCAL, REFUSED, ANSWERED, LOST})


class Failure(Record):
    """How an attempt failed, as far as the shell could tell: see the delivery constants above."""

    __slots__ = __match_args__ = ("retryable", "reply", "delivery", "retry_after", "joinable")
    retryable: bool
    reply: Reply | None
    delivery: str
    retry_after: float | None
    joinable: bool  # LOST to a callee that joins: the work may still be in flight there

    def __init__(self, retryable: bool = True, reply: Reply | None = None, delivery: str = LOCAL,
                 retry_after: float | None = None, joinable: bool = False) -> None:
        _set = object.__setattr__
        _set(self, "retryable", retryable)
        _set(self, "reply", reply)
        _set(self, "delivery", delivery)
        _set(self, "retry_after", retry_after)
        _set(self, "joinable", joinable)
        self.__post_init__()

    def __post_init__(self) -> None:
        if self.delivery not in DELIVERIES:
            raise ValueError(f"delivery must be one of {sorted(DELIVERIES)}, got {self.delivery!r}")


def settle(account: Account, held: int, delivery: str, reply: Reply | None) -> None:
    """Settle the budget held for a call to another process once its outcome is known.

    A reply returns what it says is left (never more than was held). A response without one comes
    from a callee that is not askonce-aware and so spent nothing of ours. A refused call spent
    nothing. A lost call (sent, no response) may have spent everything it was forwarded: fail
    closed, return nothing.
    """
    if delivery == LOST and reply is None:
        return
    if reply is not None:
        account.release(min(held, reply.budget))
    else:
        account.release(held)


# Two deadlines within a millisecond are the same: the header carries whole milliseconds.
_SAME_DEADLINE = 0.001
# With a grace, what a hop keeps back of the question's own deadline for its callee's answer to
# reach it.
QUESTION_MARGIN = 0.02


# An attempt's (seconds given to the callee, the question's seconds left).
Sent = tuple[float, float | None]


def attempt_window(limit: float | None, grace: float, deadline: float | None,
                   now: float, joins: bool = False) -> tuple[float | None, Sent | None]:
    """The seconds an attempt sent at ``now`` gives its callee, and what :func:`own_deadline` needs.

    ``limit``: how long the caller waits; ``deadline``: the question's. The callee gets ``grace``
    seconds fewer, and never more than a tenth of ``limit`` fewer: an askonce callee answers at its
    deadline with the budget it has left, and that answer must arrive while the caller still waits,
    or the call is lost and what it forwarded is forfeited (fail closed). Where the question's
    deadline, not the attempt's timeout, sets the limit, a retry after the callee's answer could not
    fit anyway; what the answer still brings back is the budget it reports, for the callers above,
    so the callee loses only ``QUESTION_MARGIN`` of the question's time at each hop instead of the
    whole grace. Without a grace (or a limit) the callee gets the limit and nothing is noted: its
    answer at that deadline stays a do-not-retry. A callee that ``joins`` gets the question's whole
    time left (``None``: no deadline): its work outlives this attempt, and a retry of a timed-out
    try re-attaches to it (:meth:`RetryState.on_failure`).
    """
    if joins:
        return (None if deadline is None else deadline - now), None
    if limit is None or grace <= 0:
        return limit, None
    left = None if deadline is None else deadline - now
    forwarded = limit - min(grace, 0.1 * limit)
    if left is not None and limit >= left - _SAME_DEADLINE:
        forwarded = limit - min(grace, 0.1 * limit, QUESTION_MARGIN)
    return forwarded, (forwarded, left)


def own_deadline(failure: Failure, forwarded: float | None, left: float | None) -> Failure:
    """A callee's ``deadline`` give-up, read against the deadline this caller gave it.

    If the attempt gave the callee less time than the question had left (``forwarded`` < ``left`` by
    more than ``QUESTION_MARGIN``, both seconds at sending; ``left`` ``None``: no question
    deadline), the callee ran out of *this attempt's* time, not the question's: a timeout that the
    callee answered. It is retried like a timeout, with the budget the reply says is left, and the
    question's own deadline and budget still decide. Any other failure is returned as it is.
    """
    reply = failure.reply
    if reply is None or not reply.dnr or reply.reason != "deadline" or forwarded is None:
        return failure
    if left is not None and forwarded >= left - QUESTION_MARGIN - _SAME_DEADLINE:
        return failure  # the question's own deadline set the attempt's: no retry could fit after it
    return Failure(True, Reply(reply.budget), ANSWERED, failure.retry_after)


class Attempt(NamedTuple):
    number: int
    hop: Hop


class Wait(NamedTuple):
    seconds: float


class Acquire(NamedTuple):
    """Take one retry token from the per-target bucket, then call ``RetryState.acquired(ok, now)``.

    The bucket may live in another process (Redis), so taking the token is the shell's I/O; the core
    only says when in the order of checks it is needed.
    """

    target: str | None = None


class Why(StrEnum):
    """Why a layer gave up. The first seven are askonce's limits (an askonce exception); the last
    three are the layer's own (the original error is re-raised, the reply attached)."""

    EXHAUSTED = "exhausted"  # the question's budget is spent
    DEADLINE = "deadline"  # no attempt fits before the question's deadline
    DNR = "dnr"  # a callee said do-not-retry; passed on
    PUSHBACK = "pushback"  # a callee asked to wait longer than max_pushback
    THROTTLED = "throttled"  # the per-target retry token bucket is empty
    BREAKER_OPEN = "breaker-open"  # the target's circuit breaker refused the attempt
    SHED = "shed"  # adaptive admission refused the attempt: the target fails nearly every call
    NOT_RETRYABLE = "not-retryable"  # the failure is not one this layer retries
    NOT_IDEMPOTENT = "not-idempotent"  # an unsafe request that may have reached the callee
    ATTEMPTS = "attempts"  # this layer's own attempt limit


class GiveUp(NamedTuple):
    """The end of this layer's tries. ``kind`` says why; ``reply`` is what to tell the caller."""

    kind: Why
    reply: Reply

    @property
    def reason(self) -> str | None:
        return self.reply.reason


def fits(policy: RetryPolicy, deadline: float | None, now: float, wait: float = 0.0) -> bool:
    """May an attempt start after ``wait`` seconds and have ``min_attempt`` before the deadline?

    The first-attempt check of :meth:`RetryState.start`, exposed so that a shell's success path can
    make it without building a state for a call that will most likely succeed.
    """
    return deadline is None or now + wait + policy.min_attempt < deadline


# A layer's first attempt, by layer name: the same immutable value for every call it makes.
# Bounded: the cache starts over when it holds ``_MAX_FIRST`` names.
_FIRST: dict[str, Attempt] = {}
_MAX_FIRST = 256


def _first_attempt(layer: str) -> Attempt:
    if len(_FIRST) >= _MAX_FIRST:
        _FIRST.clear()
    first = _FIRST[layer] = Attempt(1, Hop(layer, 1))
    return first


# The replies of an answer with nothing to say but the budget left, shared: a Reply is immutable.
_PLAINS = 64
_PLAIN = tuple(Reply(n) for n in range(_PLAINS))


class RetryState:
    """The state of one call at one layer: which attempt it is on and when it started."""

    __slots__ = ("_floor", "_u", "attempt", "bucket", "held", "layer", "policy", "rejoin", "sent",
                 "tab")

    def __init__(self, policy: RetryPolicy, tab: Tab, layer: str, bucket: bool = False) -> None:
        self.policy = policy
        self.tab = tab
        self.layer = layer
        self.bucket = bucket  # does a retry need a token from a per-target bucket?
        self.attempt = 1
        self.held = 0
        self.sent: Sent | None = None  # the latest attempt's window, with a deadline grace
        self.rejoin = False  # the next attempt re-attaches to a timed-out try's work in flight
        self._floor = 0.0
        self._u = 0.0

    def forward(self) -> int:
        """Before sending an attempt to another process: hold the budget to forward with it (a
        re-attach forwards what is still held for the work it joins)."""
        if not self.rejoin:
            account = self.tab.account
            self.held = held = account.hold(account.left)
            return held
        return self.held

    def unsent(self) -> None:
        """The attempt :meth:`forward` held for was never sent (its header could not be built):
        give back what was held."""
        self._settle(REFUSED, None)

    def given(self, limit: float | None, grace: float, now: float,
              joins: bool = False) -> float | None:
        """Before sending an attempt that waits ``limit`` seconds: the seconds its callee is given
        (:func:`attempt_window`), noted so that :meth:`on_failure` reads the callee's answer at that
        deadline as a timeout (:func:`own_deadline`)."""
        forwarded, self.sent = attempt_window(limit, grace, self.tab.deadline, now, joins)
        return forwarded

    def _settle(self, delivery: str, reply: Reply | None) -> None:
        if self.rejoin:
            # What is held went with the first try, which reached the callee: only a reply
            # returns any of it (a refused or lost re-attach is settled fail closed).
            self.rejoin = False
            if reply is None:
                self.held = 0
                return
            delivery = ANSWERED
        if delivery != LOCAL:
            held, self.held = self.held, 0
            settle(self.tab.account, held, delivery, reply)

    def _give_up(self, kind: Why, dnr: bool = False, reason: str | None = None,
                 pushback: float | None = None) -> GiveUp:
        # What this layer tells its caller to wait is never more than it would wait itself: a
        # callee's Retry-After of a day reaches the public edge as max_pushback, not a day.
        # A NaN pushback (an in-process reply's) is a wait nobody can tell: none, as on_failure
        # has it for its own give-up.
        if pushback is not None and not pushback <= self.policy.max_pushback:
            pushback = self.policy.max_pushback if pushback == pushback else None
        return GiveUp(kind, Reply(self.tab.account.left, dnr, reason, pushback))

    def _fits(self, now: float, wait: float) -> bool:
        return fits(self.policy, self.tab.deadline, now, wait)

    def start(self, now: float) -> Attempt | GiveUp:
        """The first attempt, unless the deadline has already passed."""
        if not self._fits(now, 0.0):
            return self._give_up(Why.DEADLINE, True, "deadline")
        layer = self.layer
        first = _FIRST.get(layer)
        if first is None:
            first = _first_attempt(layer)
        return first

    def on_failure(self, failure: Failure, now: float, u: float) -> Wait | Acquire | GiveUp:
        """Decide after a failed attempt; ``u`` is a uniform draw in [0, 1) for the jitter."""
        if self.sent is not None:
            failure = own_deadline(failure, *self.sent)
        policy, account, reply = self.policy, self.tab.account, failure.reply
        if failure.joinable and failure.delivery == LOST and reply is None and failure.retryable:
            return self._reattach(now, u)
        self._settle(failure.delivery, reply)
        if not failure.retryable:
            return self._give_up(Why.NOT_RETRYABLE, *_passed_on(reply))
        if not policy.idempotent and failure.delivery != REFUSED:
            return self._give_up(Why.NOT_IDEMPOTENT, *_passed_on(reply))
        if account.left < 1:
            return self._give_up(Why.EXHAUSTED, True, "exhausted")
        if not self._fits(now, 0.0):
            return self._give_up(Why.DEADLINE, True, "deadline")
        if reply is not None and reply.dnr:
            return self._give_up(Why.DNR, True, reply.reason, reply.pushback)
        pushback = reply.pushback if reply is not None and reply.pushback is not None else 0.0
        floor = max(pushback, failure.retry_after or 0.0)
        # `not <=` gives up on NaN too (an in-process reply's): a wait nobody can tell isn't waited.
        if not floor <= policy.max_pushback:
            return self._give_up(Why.PUSHBACK, True, "overloaded",
                                 floor if floor == floor else None)
        if self.attempt >= policy.attempts:
            return self._attempts_spent()
        self._floor, self._u = floor, u
        if self.bucket:
            return Acquire()
        return self._backoff(now)

    def _reattach(self, now: float, u: float) -> Wait | GiveUp:
        """A try to a callee that joins timed out: its work may still be running there, holding
        what was forwarded. The retry re-attaches to that work instead of adding to it (non-
        idempotent calls too: the callee joins them by key); it pays for the arrival it makes one
        retry out of what is held, and forwards the rest. No bucket token: it adds no work."""
        wait = self.policy.backoff.delay(self.attempt, u)
        kind = (Why.EXHAUSTED if self.held < 1 else
                Why.DEADLINE if not self._fits(now, wait) else
                Why.ATTEMPTS if self.attempt >= self.policy.attempts else None)
        if kind is not None:
            self.rejoin = True
            self._settle(LOST, None)  # fail closed: the work in flight may spend all of it
            if kind is Why.ATTEMPTS:
                return self._attempts_spent()
            return self._give_up(kind, True, kind.value)
        self.held -= 1
        self.rejoin = True
        self.attempt += 1
        return Wait(wait)

    def _attempts_spent(self) -> GiveUp:
        """This layer's own attempt limit. If it retried (``one_layer``), it was the layer nearest
        the failure and has done the retrying for the question: it tells the layers above not to
        retry (reason ``retried``), whatever budget is left."""
        if self.policy.one_layer and self.attempt > 1:
            return self._give_up(Why.ATTEMPTS, True, "retried")
        return self._give_up(Why.ATTEMPTS)

    def acquired(self, ok: bool, now: float) -> Wait | GiveUp:
        """The shell took (or failed to take) the retry token that ``Acquire`` asked for."""
        if not ok:
            return self._give_up(Why.THROTTLED, True, "throttled")
        return self._backoff(now)

    def _backoff(self, now: float) -> Wait | GiveUp:
        account = self.tab.account
        wait = max(self._floor, self.policy.backoff.delay(self.attempt, self._u))
        if not self._fits(now, wait):
            return self._give_up(Why.DEADLINE, True, "deadline")
        if not account.spend(1):  # a sibling took the last retry between our check and now
            return self._give_up(Why.EXHAUSTED, True, "exhausted")
        self.attempt += 1
        return Wait(wait)

    def breaker_open(self, now: float, retry_at: float | None) -> GiveUp:
        """The breaker refused the attempt: tell the caller not to retry, and when to come back."""
        pushback = None if retry_at is None else max(0.0, retry_at - now)
        return self._give_up(Why.BREAKER_OPEN, True, "breaker-open", pushback)

    def refused(self) -> GiveUp:
        """The admission controller shed the attempt (``core.admission``): the target is failing
        nearly every call; tell the caller not to retry."""
        return self._give_up(Why.SHED, True, "shed")

    def resume(self, now: float) -> Attempt | GiveUp:
        """After the wait: the next attempt, unless the deadline passed while waiting."""
        if not self._fits(now, 0.0):
            return self._give_up(Why.DEADLINE, True, "deadline")
        return Attempt(self.attempt, Hop(self.layer, self.attempt))

    def on_success(self, reply: Reply | None, delivery: str = ANSWERED) -> Reply:
        """After a successful attempt: settle what was held; the reply for our own caller."""
        self._settle(delivery, reply)
        left = self.tab.account.left
        return _PLAIN[left] if type(left) is int and 0 <= left < _PLAINS else Reply(left)


def _passed_on(reply: Reply | None) -> tuple[bool, str | None, float | None]:
    """A give-up of our own still passes on a callee's do-not-retry, so no one above retries."""
    if reply is not None and reply.dnr:
        return True, reply.reason, reply.pushback
    return False, None, None
