"""askonce's exceptions: one base, a small tree, foreign errors kept as ``__cause__``.

::

    AskonceError
    ├── GaveUp               a layer stopped trying; .askonce_reply: what it tells its caller
    │   ├── BudgetExhausted  the question's retry budget is spent (reason "exhausted")
    │   ├── DeadlineExceeded no attempt could finish before the deadline (reason "deadline")
    │   ├── DoNotRetry       a callee said do-not-retry (overloaded, cap, ...): passed on
    │   ├── RetryThrottled   this client's retry token bucket for the target is empty
    │   └── CircuitOpen      the target's breaker is open; .retry_at: when it probes again
    └── AnswerLost           a try taken in async mode (202) lost its answer; .gone: 404 there

A give-up for the layer's *own* limits (attempts used up, not retryable, not idempotent)
re-raises the original exception instead, with the reply attached as ``exc.askonce_reply``
where Python allows it, so that callers keep catching what they already catch.
"""

from __future__ import annotations

import contextlib

from askonce.core.retry import LOCAL, REFUSED, Failure, GiveUp, Why
from askonce.core.wire import Reply


class AskonceError(Exception):
    """The base of every error askonce raises."""


class GaveUp(AskonceError):
    """A layer stopped retrying a question and returns the failure."""

    reason: str | None

    def __init__(self, message: str, *, reply: Reply, layer: str, key: str | None,
                 attempts: int) -> None:
        super().__init__(message)
        # The one spelling of a reply on any exception, ours or a foreign one (``attach_reply``).
        self.askonce_reply = reply
        self.reason = reply.reason
        self.layer = layer
        self.key = key
        self.attempts = attempts


class BudgetExhausted(GaveUp):
    """The question's retry budget is spent: nobody on its path retries any more."""


class DeadlineExceeded(GaveUp, TimeoutError):
    """No attempt could start and finish before the question's deadline."""


class DoNotRetry(GaveUp):
    """A callee (or this layer, over a too-long pushback) said not to retry; the reason is
    passed on."""


class RetryThrottled(GaveUp):
    """This client spent its retry tokens for the target (a ratio of its requests plus a floor)."""


class CircuitOpen(GaveUp):
    """The target's breaker is open; no call is made until ``retry_at`` (monotonic seconds)."""

    def __init__(self, message: str, *, reply: Reply, layer: str, key: str | None, attempts: int,
                 retry_at: float | None = None) -> None:
        super().__init__(message, reply=reply, layer=layer, key=key, attempts=attempts)
        self.retry_at = retry_at


class AnswerLost(AskonceError):
    """A try that a callee took in async mode (``ClientPolicy(respond_async=True)``: 202 and a
    status location) did not get its answer: ``gone`` (the location answered 404: the answer was
    not kept, expired, or the run ended without one; never retried, the run may have done the
    work), or the question's deadline came, or the polls' errors ran out (lost as a timed-out try
    is). Settled fail closed: the budget the try forwarded is not returned."""

    def __init__(self, message: str, *, gone: bool) -> None:
        super().__init__(message)
        self.gone = gone


_BY_KIND: dict[Why, type[GaveUp]] = {
    Why.EXHAUSTED: BudgetExhausted,
    Why.DEADLINE: DeadlineExceeded,
    Why.DNR: DoNotRetry,
    Why.PUSHBACK: DoNotRetry,
    Why.THROTTLED: RetryThrottled,
    Why.BREAKER_OPEN: CircuitOpen,
    Why.SHED: CircuitOpen,
}

_MESSAGES = {
    Why.EXHAUSTED: "retry budget exhausted",
    Why.DEADLINE: "deadline exceeded",
    Why.DNR: "callee said do not retry",
    Why.PUSHBACK: "callee asked to wait longer than this layer's max_pushback",
    Why.THROTTLED: "retry token bucket for the target is empty",
    Why.BREAKER_OPEN: "circuit breaker is open",
    Why.SHED: "attempt shed: the target fails nearly every call",
}


def attach_reply(exc: BaseException, reply: Reply) -> None:
    """Attach a reply to a foreign exception so an outer layer or server middleware can read it."""
    with contextlib.suppress(AttributeError, TypeError):  # exceptions with __slots__: nothing to do
        exc.askonce_reply = reply  # type: ignore[attr-defined]


def reply_of(exc: object) -> Reply | None:
    """The reply an exception, or the response it wraps (httpx/requests status errors), carries."""
    reply = getattr(exc, "askonce_reply", None)
    if reply is None:  # httpx.HTTPStatusError, requests.HTTPError: the give-up rode on the response
        reply = getattr(getattr(exc, "response", None), "askonce_reply", None)
    return reply if isinstance(reply, Reply) else None


def failure_of(exc: BaseException) -> Failure:
    """What an exception says about a failed in-process attempt.

    Budget held for calls to other processes is settled where the call is made
    (``askonce.outgoing``), so here the delivery is local; an exception marked
    ``askonce_reached = False`` (the request provably never left) lets a non-idempotent call be
    retried. ``askonce_reply`` carries a callee's do-not-retry upward; ``askonce_retry_after``
    (seconds) lengthens the wait.
    """
    retry_after = getattr(exc, "askonce_retry_after", None)
    return Failure(
        retryable=True,
        reply=reply_of(exc),
        delivery=REFUSED if getattr(exc, "askonce_reached", None) is False else LOCAL,
        retry_after=float(retry_after) if isinstance(retry_after, int | float) else None,
    )


def error_for(give_up: GiveUp, last: BaseException | None, *, layer: str, key: str | None,
              attempts: int, retry_at: float | None = None) -> BaseException:
    """The exception a shell raises for a give-up: ours for askonce's limits, else the original."""
    if isinstance(last, GaveUp) and give_up.reply.dnr:
        return last  # an inner layer already gave up for the question: a wrapper adds nothing
    if give_up.kind is Why.DNR and give_up.reply.reason == "retried" and last is not None:
        # An inner layer retried and reached its own limit: its error is the question's answer,
        # as it would have been had this layer not wrapped it.
        attach_reply(last, give_up.reply)
        return last
    cls = _BY_KIND.get(give_up.kind)
    if cls is None:
        if last is None:  # cannot happen for the layer's own limits, which follow an attempt
            return AskonceError(f"{layer}: gave up ({give_up.kind})")
        attach_reply(last, give_up.reply)
        return last
    detail = (f" ({give_up.reply.reason})" if give_up.kind is Why.DNR and give_up.reply.reason
              else "")
    message = (f"{layer}: {_MESSAGES[give_up.kind]}{detail} after {attempts} attempt(s), "
               f"question {key}")
    if cls is CircuitOpen:
        return CircuitOpen(message, reply=give_up.reply, layer=layer, key=key, attempts=attempts,
                           retry_at=retry_at)
    return cls(message, reply=give_up.reply, layer=layer, key=key, attempts=attempts)
