"""A sans-IO circuit breaker: a state machine fed with outcomes and the current time.

State diagram::

                failure-rate | slow-call-rate
                (>= minimum_calls in the window)
     +--------+ ----------------------------------> +------+ <-----------------+
     | CLOSED |                                     | OPEN |                   |
     +--------+ <--+                                +------+                   |
                   |                                   |  open-elapsed         | probe-failed
                   | probes-succeeded                  |  (now >= opened_at    | probe-slow
                   | (half_open_probes successes)      v   + open_for)         |
                   |                              +-----------+                |
                   +----------------------------- | HALF_OPEN | ---------------+
                                                  +-----------+

    force_open() / force_closed() jump from any state (reason "forced"); hold_open() opens until a
    given time (reason "seeded": a local fallback seeded with a shared breaker, core.fallback).

CLOSED admits every call and judges a sliding window of outcomes: once it holds ``minimum_calls``
calls and failures/calls >= ``failure_rate`` (or slow/calls >= ``slow_call_rate``, if
``slow_call_duration`` is set), it opens. The window is either the last ``window_size`` calls (a
ring of outcomes) or the last ``window_size`` seconds (a ring of one-second buckets, rolled lazily
from ``now``); both keep running totals and memory bounded by ``window_size``. A record costs O(1);
rolling the time window costs one step per elapsed second, capped at O(1) once a whole window has
elapsed (the totals are simply zeroed). A call counts as slow when
``duration >= slow_call_duration``, whether it succeeded or failed.

OPEN admits nothing until ``open_for`` seconds have passed; the next
``allow``/``state_at``/``record`` call then moves it to HALF_OPEN. HALF_OPEN admits at most
``half_open_probes`` probes; the first probe that fails (or is slow, when slow calls are judged)
reopens the breaker, and when all of them have succeeded it closes. The window is reset on entering
OPEN and on entering CLOSED, so a verdict never rests on outcomes from before the last change.
Without tokens the breaker cannot tell a probe from a call admitted before it opened, so it guesses:
outcomes recorded in OPEN are ignored, and so are outcomes recorded in HALF_OPEN while no probe is
in flight.

What counts as a failure is the caller's business; the breaker only sees ``success``. The shells
call ``record(success=False)`` for a do-not-retry reply whose reason is ``overloaded`` (the target
asked us to back off, which is exactly what the breaker is for) and ``release()`` for the client's
own 4xx: that call says nothing about the target's health, but it may hold a half-open probe slot
that must be freed.

Time is an input (monotonic seconds), never read here. A ``now`` earlier than one already seen is
treated as the latest time seen, so racy callers or a mixed-up clock cannot reorder history or
reopen the past; a non-finite ``now`` is a bug in the caller and raises ``ValueError``.
The object holds no lock; the shells serialise access to it.

Fast successes can be recorded in bulk: ``record_successes(now, n)`` is ``state_at(now)`` followed
by ``n`` times ``record(now, success=True)``, at O(1) for a time window and O(min(n, window_size))
byte operations (memset and count, no Python loop) for a count window. ``quiet_until`` says when a
shell may defer successes: before that time (for a count window, for ever) the breaker is closed
with enough calls and rates under the thresholds, so one more fast success can only lower the rates
and cannot change the state. A shell that counts such successes without its lock and folds them in
with ``record_successes`` before its next locked operation behaves like one that recorded each
(``stores.memory`` does).
"""

from __future__ import annotations

import enum
import math
from collections import deque
from typing import Final, Literal

from askonce.core import is_int, is_real
from askonce.core.breaker_window import FAIL, SLOW, CountWindow, TimeWindow, Window
from askonce.core.record import Record

__all__ = ["Breaker", "BreakerPolicy", "State", "Transition"]

_MAX_TRANSITIONS: Final = 64
_MAX_COUNT_WINDOW: Final = 1_000_000  # calls: one byte each
_MAX_TIME_WINDOW: Final = 86_400  # seconds: one day of buckets




class BreakerPolicy(Record):
    """When a circuit breaker opens and how it probes.

    The defaults are for a dependency that is either up or down: the breaker opens only on
    near-total failure sustained over a full window (99 % of the last 100 calls), so a
    half-working dependency is left to adaptive admission (``core.admission``), which sheds in
    proportion instead. A classic 50 % breaker is ``BreakerPolicy(failure_rate=0.5,
    minimum_calls=20)``.
    """

    __slots__ = __match_args__ = ("window", "window_size", "minimum_calls", "failure_rate",
                                  "slow_call_rate", "slow_call_duration", "open_for",
                                  "half_open_probes")
    window: Literal["count", "time"]
    window_size: int  # calls for a count window; whole seconds for a time window
    minimum_calls: int  # no verdict before the window holds this many calls
    failure_rate: float  # open when failures/calls >= this
    slow_call_rate: float  # open when slow/calls >= this (only if slow_call_duration is set)
    # Seconds; a call at least this slow is slow; None disables.
    slow_call_duration: float | None
    open_for: float  # seconds in OPEN before probes are admitted (docs/results.md: why 2)
    half_open_probes: int  # probes admitted in HALF_OPEN; all must succeed to close

    def __init__(self, window: Literal["count", "time"] = "count", window_size: int = 100,
                 minimum_calls: int = 100, failure_rate: float = 0.99, slow_call_rate: float = 1.0,
                 slow_call_duration: float | None = None, open_for: float = 2.0,
                 half_open_probes: int = 3) -> None:
        _set = object.__setattr__
        _set(self, "window", window)
        _set(self, "window_size", window_size)
        _set(self, "minimum_calls", minimum_calls)
        _set(self, "failure_rate", failure_rate)
        _set(self, "slow_call_rate", slow_call_rate)
        _set(self, "slow_call_duration", slow_call_duration)
        _set(self, "open_for", open_for)
        _set(self, "half_open_probes", half_open_probes)
        self.__post_init__()

    def __post_init__(self) -> None:
        if self.window not in ("count", "time"):
            raise ValueError(f"breaker window must be 'count' or 'time', got {self.window!r}")
        # The window's memory is allocated up front, so an absurd size is refused, not honoured.
        limit = _MAX_COUNT_WINDOW if self.window == "count" else _MAX_TIME_WINDOW
        if not is_int(self.window_size) or not 1 <= self.window_size <= limit:
            raise ValueError(
                f"breaker {self.window} window_size must be an int within 1..{limit}, "
                f"got {self.window_size!r}"
            )
        if not is_int(self.minimum_calls) or self.minimum_calls < 1:
            raise ValueError(
                f"breaker minimum_calls must be an int >= 1, got {self.minimum_calls!r}"
            )
        if self.window == "count" and self.minimum_calls > self.window_size:
            # A count window never holds more than window_size calls: the breaker could never open.
            raise ValueError(
                f"breaker minimum_calls ({self.minimum_calls}) must not exceed a count "
                f"window_size ({self.window_size})"
            )
        for name in ("failure_rate", "slow_call_rate"):
            rate = getattr(self, name)
            # Written so that NaN fails the check too.
            if not is_real(rate) or not 0 < rate <= 1:
                raise ValueError(f"breaker {name} must be within (0, 1], got {rate!r}")
        duration = self.slow_call_duration
        if duration is not None and (not is_real(duration) or not 0 < duration < math.inf):
            raise ValueError(
                f"breaker slow_call_duration must be None or finite > 0, got {duration!r}"
            )
        if not is_real(self.open_for) or not 0 < self.open_for < math.inf:
            raise ValueError(f"breaker open_for must be finite > 0 seconds, got {self.open_for!r}")
        if not is_int(self.half_open_probes) or self.half_open_probes < 1:
            raise ValueError(
                f"breaker half_open_probes must be an int >= 1, got {self.half_open_probes!r}"
            )


class State(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"


# Module-level names: looking a member up on an Enum class is slow, and the hot paths would do it
# several times per call.
_CLOSED: Final = State.CLOSED
_OPEN: Final = State.OPEN
_HALF_OPEN: Final = State.HALF_OPEN


class Transition(Record):
    """A change of a breaker's state, as its listeners are told it."""

    __slots__ = __match_args__ = ("old", "new", "at", "reason")
    old: State
    new: State
    # When the change took effect (for open-elapsed: the deadline, not when it was noticed).
    at: float
    # failure-rate, slow-call-rate, open-elapsed, probe-failed, probe-slow, probes-succeeded,
    # forced or seeded
    reason: str

    def __init__(self, old: State, new: State, at: float, reason: str) -> None:
        _set = object.__setattr__
        _set(self, "old", old)
        _set(self, "new", new)
        _set(self, "at", at)
        _set(self, "reason", reason)


class Breaker:
    """One circuit breaker. Not thread-safe by design: the shells hold a lock around it."""

    __slots__ = (
        "_dropped",
        "_now",
        "_opened_at",
        "_policy",
        "_probes_admitted",
        "_probes_succeeded",
        "_state",
        "_transitions",
        "_window",
    )

    # A shared default is safe: the policy is frozen.
    def __init__(self, policy: BreakerPolicy = BreakerPolicy()) -> None:
        self._policy = policy
        self._window: Window = (
            CountWindow(policy.window_size) if policy.window == "count"
            else TimeWindow(policy.window_size)
        )
        self._state = _CLOSED
        self._now: float | None = None
        self._opened_at: float | None = None
        # Admitted probes that have not been released; those beyond _probes_succeeded are in flight.
        self._probes_admitted = 0
        self._probes_succeeded = 0
        self._transitions: deque[Transition] = deque(maxlen=_MAX_TRANSITIONS)
        self._dropped = 0

    @property
    def state(self) -> State:
        return self._state

    @property
    def now(self) -> float | None:
        """The latest time seen (``None`` before the first call)."""
        return self._now

    @property
    def quiet_until(self) -> float:
        """Before this time a fast success cannot change the state; ``-inf`` if it might now.

        Closed, at least ``minimum_calls`` in the window and both rates under their thresholds: one
        more success only lowers the rates. A count window stays so for ever (``inf``, until another
        kind of call); a time window until the current second ends, when outcomes may age out and
        raise a rate.
        """
        window, policy = self._window, self._policy
        calls = window.calls
        if (
            self._state is not _CLOSED
            or self._now is None
            or calls < policy.minimum_calls
            or window.failures / calls >= policy.failure_rate
            or (policy.slow_call_duration is not None
                and window.slow / calls >= policy.slow_call_rate)
        ):
            return -math.inf
        return math.inf if policy.window == "count" else math.floor(self._now) + 1

    def state_at(self, now: float) -> State:
        self._tick(now)
        return self._state

    def allow(self, now: float) -> bool:
        self._tick(now)
        if self._state is _CLOSED:
            return True
        if self._state is _HALF_OPEN and self._probes_admitted < self._policy.half_open_probes:
            self._probes_admitted += 1
            return True
        return False

    def retry_at(self) -> float | None:
        if self._state is _OPEN and self._opened_at is not None:
            return self._opened_at + self._policy.open_for
        return None

    def record(self, now: float, *, success: bool, duration: float = 0.0) -> None:
        now = self._tick(now)
        policy = self._policy
        slow = policy.slow_call_duration is not None and duration >= policy.slow_call_duration
        if self._state is _CLOSED:
            self._window.add(now, (0 if success else FAIL) | (SLOW if slow else 0))
            self._judge(now)
        elif self._state is _HALF_OPEN:
            if self._probes_admitted <= self._probes_succeeded:
                # No probe in flight: a straggler admitted before the breaker opened. Its verdict is
                # about the past, and letting it close or reopen the breaker would skip the probing.
                return
            if not success:
                self._move(_OPEN, now, "probe-failed")
            elif slow:
                # A slow probe is not health: closing on it would only reopen on slow-call-rate.
                self._move(_OPEN, now, "probe-slow")
            else:
                self._probes_succeeded += 1
                if self._probes_succeeded >= policy.half_open_probes:
                    self._move(_CLOSED, now, "probes-succeeded")
        # In OPEN the outcome is from a call admitted before opening; the window was reset then.

    def record_successes(self, now: float, n: int) -> None:
        """``state_at(now)``, then ``n`` times ``record(now, success=True)``, without a loop over
        ``n``."""
        if not is_int(n) or n < 0:
            raise ValueError(f"breaker record_successes needs an int n >= 0, got {n!r}")
        now = self._tick(now)
        policy = self._policy
        while n:
            if self._state is _CLOSED:
                window = self._window
                # Only the success that brings the window to minimum_calls (or the first, once it is
                # there) can open the breaker: each later one at the same time only lowers the
                # rates.
                first = min(n, max(policy.minimum_calls - window.calls, 1))
                window.add_successes(now, first)
                self._judge(now)
                n -= first
                if n and self._state is _CLOSED:
                    window.add_successes(now, n)
                return  # if it opened, the rest arrive in OPEN, where outcomes are ignored
            in_flight = self._probes_admitted - self._probes_succeeded
            if self._state is _OPEN or in_flight <= 0:
                return  # stragglers, as in record()
            taken = min(n, in_flight)
            self._probes_succeeded += taken
            n -= taken
            if self._probes_succeeded < policy.half_open_probes:
                return  # the rest, if any, found no probe in flight
            self._move(_CLOSED, now, "probes-succeeded")  # and the rest feed the fresh window

    def release(self, now: float) -> None:
        self._tick(now)
        if self._state is _HALF_OPEN and self._probes_admitted > self._probes_succeeded:
            self._probes_admitted -= 1

    def drain_transitions(self) -> list[Transition]:
        drained = list(self._transitions)
        self._transitions.clear()
        return drained

    def at_rest(self) -> bool:
        """Closed with no failure or slow call in its window: forgetting it loses nothing (a new
        breaker would be the same). A store evicts such breakers before engaged ones. Read-only:
        it moves no state and queues no transition (a store asks it under its own lock)."""
        window = self._window
        return self._state is _CLOSED and window.failures == 0 and window.slow == 0

    def snapshot(self) -> dict[str, object]:
        """Counters as of the latest ``now`` seen (a time window is not rolled here)."""
        window = self._window
        return {
            "state": self._state.value,
            "window": self._policy.window,
            "calls": window.calls,
            "failures": window.failures,
            "slow": window.slow,
            "opened_at": self._opened_at,
            "retry_at": self.retry_at(),
            "probes_admitted": self._probes_admitted,
            "probes_succeeded": self._probes_succeeded,
            "now": self._now,
            "transitions_pending": len(self._transitions),
            "transitions_dropped": self._dropped,
        }

    def force_open(self, now: float) -> None:
        now = self._tick(now)
        if self._state is _OPEN:
            # Not a state change, so no transition; forcing again restarts the open period.
            self._opened_at = now
        else:
            self._move(_OPEN, now, "forced")

    def hold_open(self, now: float, until: float) -> None:
        """Open, refusing calls until ``until`` (then half-open as usual): a local breaker seeded
        with a shared one's open period (``core.fallback``). From any state; a breaker not open
        yet moves with reason ``seeded``."""
        if not math.isfinite(until):
            raise ValueError(f"breaker hold_open needs a finite time, got {until!r}")
        now = self._tick(now)
        if self._state is not _OPEN:
            self._move(_OPEN, now, "seeded")
        self._opened_at = until - self._policy.open_for

    def force_closed(self, now: float) -> None:
        now = self._tick(now)
        if self._state is _CLOSED:
            # Not a state change, so no transition; forcing closed still forgives the window.
            self._window.reset()
        else:
            self._move(_CLOSED, now, "forced")

    def _tick(self, now: float) -> float:
        if not math.isfinite(now):
            raise ValueError(f"breaker time must be finite seconds, got {now!r}")
        if self._now is not None and now < self._now:
            # Racy callers in a shell can deliver times out of order; taking the latest keeps the
            # window and the open period monotonic instead of crashing or reopening the past.
            now = self._now
        self._now = now
        if self._state is _OPEN and self._opened_at is not None:
            deadline = self._opened_at + self._policy.open_for
            if now >= deadline:
                self._move(_HALF_OPEN, deadline, "open-elapsed")
        elif self._state is _CLOSED:
            self._window.roll(now)
        return now

    def _judge(self, now: float) -> None:
        window, policy = self._window, self._policy
        if window.calls < policy.minimum_calls:
            return
        if window.failures / window.calls >= policy.failure_rate:
            self._move(_OPEN, now, "failure-rate")
        elif (policy.slow_call_duration is not None
              and window.slow / window.calls >= policy.slow_call_rate):
            self._move(_OPEN, now, "slow-call-rate")

    def _move(self, new: State, at: float, reason: str) -> None:
        if len(self._transitions) == _MAX_TRANSITIONS:
            self._dropped += 1
        self._transitions.append(Transition(self._state, new, at, reason))
        self._state = new
        self._probes_admitted = self._probes_succeeded = 0
        if new is _OPEN:
            self._opened_at = at
            # Only CLOSED feeds the window, so this one reset also leaves it empty when it closes
            # again.
            self._window.reset()
        elif new is _CLOSED:
            self._opened_at = None
