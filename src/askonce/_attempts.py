"""The iterator form of ``askonce.retry``: ``for attempt in retry(...): with attempt: ...``.

One pass (``_Run``) holds the call's ``RetryState``; each ``AttemptContext`` binds the question for its
block and reports how the block ended. The decisions are the core's, as in the decorator.
"""

from __future__ import annotations

from contextvars import Token
from types import TracebackType
from typing import TYPE_CHECKING, cast

from askonce.context import _frame
from askonce.core.question import Frame
from askonce.core.retry import Acquire, Attempt, GiveUp, RetryState, Wait
from askonce.errors import failure_of
from askonce.stores.base import BreakerHandle

if TYPE_CHECKING:
    from askonce.retrying import retry


class _Run:
    """The state of one pass through the iterator form."""

    def __init__(self, owner: retry, layer: str) -> None:
        self.owner = owner
        self.tab, self.path = owner._frame(layer)
        self.bucket = owner._bucket(layer)
        self.breaker = owner._breaker(layer)
        self.state = RetryState(owner.policy, self.tab, layer, self.bucket is not None)
        self.action: Attempt | Wait | Acquire | GiveUp = self.state.start(owner._clock())
        self.last: BaseException | None = None
        if self.bucket is not None:
            self.bucket.deposit()

    def next_attempt(self) -> AttemptContext:
        if type(self.action) is Wait:  # the wait has been served: decide now whether to go on
            self.action = self.state.resume(self.owner._clock())
        if type(self.action) is not Attempt:
            self.owner._raise(cast(GiveUp, self.action), self.last, self.state)
        started = self.owner._clock()
        if self.breaker is not None and not self.breaker.allow(started):
            retry_at = self.breaker.retry_at()
            self.owner._raise(self.state.breaker_open(started, retry_at), self.last, self.state, retry_at)
        return AttemptContext(self, cast(Attempt, self.action), started)

    def after(self, ctx: AttemptContext) -> float:
        """Seconds to wait before the next attempt (0 also when giving up: ``next_attempt`` raises)."""
        if ctx.error is None:
            raise RuntimeError("askonce.retry: each attempt must be used as `with attempt:`")
        owner, bucket = self.owner, self.bucket
        self.last = ctx.error
        self.action = self.state.on_failure(failure_of(ctx.error), owner._clock(), owner._random())
        if type(self.action) is Acquire:
            now = owner._clock()
            self.action = self.state.acquired(bucket is not None and bucket.withdraw(now), now)
        return self.action.seconds if type(self.action) is Wait else 0.0


class AttemptContext:
    """One attempt of the iterator form: ``with attempt:`` runs it, with the question bound."""

    __slots__ = ("_hop", "_token", "done", "error", "number", "run", "started")

    def __init__(self, run: _Run, action: Attempt, started: float) -> None:
        self.run = run
        self.started = started
        self.number = action.number
        self._hop = action.hop
        self.done = False
        self.error: BaseException | None = None
        self._token: Token[Frame | None] | None = None

    def __enter__(self) -> AttemptContext:
        self._token = _frame.set((self.run.tab, (*self.run.path, self._hop)))
        return self

    def __exit__(self, t: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        if self._token is not None:
            _frame.reset(self._token)
            self._token = None
        breaker = self.run.breaker
        if breaker is not None:
            ended = self.run.owner._clock()
            if exc is None:
                breaker.record(ended, success=True, duration=ended - self.started)
            else:
                _verdict(breaker, exc, self.started, ended)
        if exc is None or not self.run.owner._matches(exc):
            self.done = True
            return False
        self.error = exc
        return True  # swallowed here; the iterator decides whether to try again or raise


def _verdict(breaker: BreakerHandle, exc: BaseException, started: float, ended: float) -> None:
    """Tell the breaker how an attempt that raised ended: a failure of the target, or no verdict."""
    from askonce.breakers import is_failure

    if is_failure(exc):
        breaker.record(ended, success=False, duration=ended - started)
    else:
        breaker.release(ended)
