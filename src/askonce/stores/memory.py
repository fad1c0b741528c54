"""The in-memory store: per-target retry buckets, breakers and admission shared by this process.

Deposits (one per first attempt) take no lock: a deposit lost to a thread race only makes the bucket
more conservative. Withdrawals, which decide whether a retry happens, are made under a lock, and so
is every breaker operation (the core breaker holds no lock of its own). The number of targets is
bounded; past it the oldest entry *at rest* is dropped (a closed breaker with no failure in its
window, a bucket whose floor is full: a new one would be the same; counted as
``store.memory.evicted``), so a caller that keys by unbounded names cannot grow memory without end,
nor reset an open breaker or a drained bucket by flooding it with new names.
Admission handles (``core.admission``, adaptive shedding) are bounded the same way, one lock each.

A breaker handle reports its state changes to listeners (``add_listener``); they run after the lock
is released, so a listener may call back into the breaker, and a listener that raises is counted
(``breaker.listener.error``), never passed on to the call that happened to cause the change.

A breaker's hot path, a fast success while the breaker is quiet (``Breaker.quiet_until``: closed and
settled, so that one more success cannot change its state), takes no lock either, and loses nothing:
it ticks an ``itertools.count``, whose ``next()`` is one C call and so atomic under the GIL (``+=``
on an attribute is not, in principle). Every locked operation first folds the successes counted
since the previous one into the core breaker (``record_successes``), so the core sees every call, in
order with the failures. An open breaker refuses calls without the lock too, until its ``retry_at``.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol, TypeVar

from askonce._stats import count
from askonce.core.admission import Admission, AdmissionPolicy
from askonce.core.breaker import Breaker, BreakerPolicy, State, Transition
from askonce.core.bucket import BucketPolicy, TokenBucket

__all__ = ["AdmissionHandle", "BreakerHandle", "BucketHandle", "Listener", "MemoryStore", "evict"]

Listener = Callable[[str, Transition], object]
"""Called as ``listener(target, transition)`` after a breaker changed state."""

class _Evictable(Protocol):
    def at_rest(self, now: float) -> bool: ...


H = TypeVar("H", bound=_Evictable)
_SCAN = 64  # entries looked at per eviction: bounded work per new target
K = TypeVar("K")
_CLOSED = State.CLOSED
_NEVER = -math.inf


class BucketHandle:
    """One target's bucket as a shell sees it."""

    __slots__ = ("_bucket", "_lock", "target")

    def __init__(self, target: str, bucket: TokenBucket, lock: threading.Lock) -> None:
        self.target = target
        self._bucket = bucket
        self._lock = lock

    def deposit(self) -> None:
        self._bucket.requests += 1

    def withdraw(self, now: float) -> bool:
        with self._lock:
            return self._bucket.withdraw(now)

    def tokens(self, now: float) -> float:
        with self._lock:
            return self._bucket.tokens(now)

    def at_rest(self, now: float) -> bool:
        """For the store's eviction, which holds the lock this bucket shares with the store."""
        return self._bucket.at_rest(now)


def notify(listeners: tuple[Listener, ...], target: str, transitions: list[Transition]) -> None:
    """Run listeners outside any lock; their failures are counted, not raised into the caller."""
    for transition in transitions:
        for listener in listeners:
            try:
                listener(target, transition)
            except Exception:
                count("breaker.listener.error")


class BreakerHandle:
    """One target's circuit breaker, serialised by a lock of its own.

    Satisfies ``stores.base.BreakerHandle``. The common calls take no lock: ``allow`` on a closed
    breaker (admitted) or on an open one before its ``open_for`` has passed (refused), ``record`` of
    a fast success on a quiet breaker (deferred), and ``retry_at``. Every locked operation folds the
    deferred successes in first (``_fold``) and ends in ``_settle``, which publishes what the
    lock-free paths read (``_seen``, ``_quiet_until``, ``_refuse_until``) before the lock is
    released. A lock-free path that reads them just before another thread changes the breaker acts
    as if it had run just before; a success deferred so is folded in later, like a locked record
    that lost the race for the lock (the core ignores it in OPEN and takes it for a straggler or a
    probe in HALF_OPEN, as it would).

    Transitions are drained when the state differs from the last one seen: an operation that changed
    anything ends in another state than it started in (an open-elapsed tick ends half-open, and
    nothing it can do next reverts that; a fold only adds successes, which can close a half-open
    breaker or open a closed one, never both). ``force_open`` can go open -> half-open -> open in
    one call, so the rarely used ``_run`` operations always drain.
    """

    __slots__ = ("_breaker", "_listeners", "_lock", "_mark", "_quiet_until", "_refuse_until",
                 "_seen", "_slow", "_tally", "policy", "target")

    def __init__(self, target: str, policy: BreakerPolicy) -> None:
        self.target = target
        self.policy = policy
        self._breaker = Breaker(policy)
        self._lock = threading.Lock()
        self._seen = State.CLOSED
        self._listeners: tuple[Listener, ...] = ()
        self._quiet_until = _NEVER  # a fast success before this time cannot change the state
        self._refuse_until = _NEVER  # open: a call before this time is refused
        self._slow = math.inf if policy.slow_call_duration is None else policy.slow_call_duration
        # Lock-free successes take numbers from the counter, and so does each fold: the successes
        # since the last fold are the numbers strictly between the two (no read-and-reset race).
        self._tally = itertools.count().__next__
        self._mark = -1

    def add_listener(self, listener: Listener) -> None:
        with self._lock:
            if listener not in self._listeners:
                self._listeners = (*self._listeners, listener)

    def remove_listener(self, listener: Listener) -> None:
        with self._lock:
            self._listeners = tuple(x for x in self._listeners if x != listener)

    def _fold(self) -> None:
        """Under the lock: give the core the lock-free successes, at the latest time it saw."""
        mark = self._tally()
        n = mark - self._mark - 1
        self._mark = mark
        # A deferred success needs a quiet breaker, which has seen a time: `at` is set.
        if n and (at := self._breaker.now) is not None:
            self._breaker.record_successes(at, n)

    def _settle(self, drain: bool = False) -> list[Transition] | None:
        """Under the lock, after an op: publish the state; the transitions to report, if any."""
        breaker = self._breaker
        state = breaker.state
        if state is _CLOSED:
            self._quiet_until, self._refuse_until = breaker.quiet_until, _NEVER
        else:
            retry_at = breaker.retry_at()
            self._quiet_until, self._refuse_until = _NEVER, _NEVER if retry_at is None else retry_at
        if not drain and state is self._seen:
            return None
        self._seen = state
        return breaker.drain_transitions()

    def allow(self, now: float) -> bool:
        if self._seen is _CLOSED:
            return True  # a closed breaker admits every call
        if now < self._refuse_until:
            return False  # open, and the core would refuse too: it moves on only at retry_at
        with self._lock:
            self._fold()
            ok = self._breaker.allow(now)
            moved = self._settle()
        if moved:
            notify(self._listeners, self.target, moved)
        return ok

    def record(self, now: float, *, success: bool, duration: float = 0.0) -> None:
        if success and now < self._quiet_until and duration < self._slow:
            # The next locked operation folds it in. A NaN time or duration fails a comparison and
            # goes to the core, which refuses a NaN time.
            self._tally()
            return
        with self._lock:
            self._fold()
            self._breaker.record(now, success=success, duration=duration)
            moved = self._settle()
        if moved:
            notify(self._listeners, self.target, moved)

    def release(self, now: float) -> None:
        self._run(Breaker.release, now)

    def hold_open(self, now: float, until: float) -> None:
        """Open until ``until`` (``Breaker.hold_open``): a fallback seeded with a shared breaker."""
        self._run(lambda breaker, at: breaker.hold_open(at, until), now)

    def force_open(self, now: float) -> None:
        self._run(Breaker.force_open, now)

    def force_closed(self, now: float) -> None:
        self._run(Breaker.force_closed, now)

    def _run(self, op: Callable[[Breaker, float], object], now: float) -> None:
        with self._lock:
            self._fold()
            op(self._breaker, now)
            moved = self._settle(drain=True)
        if moved:
            notify(self._listeners, self.target, moved)

    def retry_at(self) -> float | None:
        """As the core said after the last locked operation (its answer changes only under it)."""
        refuse_until = self._refuse_until
        return None if refuse_until == _NEVER else refuse_until

    def state(self, now: float) -> State:
        with self._lock:
            self._fold()
            state = self._breaker.state_at(now)
            moved = self._settle()
        if moved:
            notify(self._listeners, self.target, moved)
        return state

    def snapshot(self) -> dict[str, object]:
        """The core's counters, every deferred success included."""
        with self._lock:
            self._fold()
            snap = self._breaker.snapshot()
            moved = self._settle()
        if moved:
            notify(self._listeners, self.target, moved)
        return snap

    def at_rest(self, now: float) -> bool:
        """For the store's eviction, under the store's lock: read-only, so that no listener runs
        there (deferred successes need no folding: they cannot make a breaker engaged)."""
        with self._lock:
            return self._breaker.at_rest()


class AdmissionHandle:
    """One target's adaptive admission controller, serialised by a lock of its own.

    Satisfies ``stores.base.AdmissionHandle``: the loop calls ``admit`` before an attempt and
    ``record`` after a judged one, in place (an uncontended lock around a few additions).
    """

    __slots__ = ("_admission", "_lock", "policy", "target")

    def __init__(self, target: str, policy: AdmissionPolicy) -> None:
        self.target = target
        self.policy = policy
        self._admission = Admission(policy)
        self._lock = threading.Lock()

    def admit(self, now: float, u: float) -> bool:
        with self._lock:
            return self._admission.admit(now, u)

    def record(self, now: float, *, success: bool) -> None:
        with self._lock:
            self._admission.record(now, success=success)

    def reject_probability(self, now: float) -> float:
        with self._lock:
            return self._admission.reject_probability(now)

    def add(self, now: float, requests: int, calls: int, successes: int) -> None:
        """Count a batch (``Admission.add``): a fallback seeded with the fleet's window."""
        with self._lock:
            self._admission.add(now, requests, calls, successes)

    def snapshot(self) -> dict[str, object]:
        """The window's counters (``requests``, ``calls``, ``successes``) and ``p``."""
        with self._lock:
            return self._admission.snapshot()

    def at_rest(self, now: float) -> bool:
        with self._lock:
            return self._admission.at_rest(now)


class MemoryStore:
    """Process-local state: satisfies ``stores.base.Store``.

    ``clock`` gives a new bucket its start time.
    """

    def __init__(self, clock: Callable[[], float], max_targets: int = 4096) -> None:
        if max_targets < 1:
            raise ValueError("max_targets must be at least 1")
        self._clock = clock
        self._max = max_targets
        self._lock = threading.Lock()
        self._buckets: OrderedDict[tuple[str, BucketPolicy], BucketHandle] = OrderedDict()
        self._breakers: OrderedDict[tuple[str, BreakerPolicy], BreakerHandle] = OrderedDict()
        self._admissions: OrderedDict[tuple[str, AdmissionPolicy], AdmissionHandle] = OrderedDict()
        # Evictions so far, of any handle: a Caller that keeps the admission handles it was given
        # drops them when this moves.
        self._evicted = 0

    def bucket(self, target: str, policy: BucketPolicy) -> BucketHandle:
        key = (target, policy)
        handle = self._buckets.get(key)
        if handle is not None:
            return handle
        return self._add(self._buckets, key,
                         lambda: BucketHandle(target, TokenBucket(policy, self._clock()),
                                              self._lock))

    def breaker(self, target: str, policy: BreakerPolicy) -> BreakerHandle:
        key = (target, policy)
        handle = self._breakers.get(key)
        if handle is not None:
            return handle
        return self._add(self._breakers, key, lambda: BreakerHandle(target, policy))

    def admission(self, target: str, policy: AdmissionPolicy) -> AdmissionHandle:
        key = (target, policy)
        handle = self._admissions.get(key)
        if handle is not None:
            return handle
        return self._add(self._admissions, key, lambda: AdmissionHandle(target, policy))

    def _add(self, table: OrderedDict[K, H], key: K, make: Callable[[], H]) -> H:
        with self._lock:
            handle = table.get(key)
            if handle is None:
                handle = table[key] = make()
                if len(table) > self._max:
                    evict(table, self._clock(), "store.memory")
                    self._evicted += 1
            return handle


def evict(table: OrderedDict[K, H], now: float, counter: str) -> None:
    """Drop one entry of ``table`` (oldest first, the newest last): the oldest at rest (nothing
    lost: a new one would be the same). An engaged one (an open breaker, a drained bucket) is kept
    and looked past, so that a flood of new names cannot reset protection that is engaged. Only
    when ``_SCAN`` entries in a row are engaged does the oldest of them go. Counted as
    ``<counter>.evicted`` or ``<counter>.evicted-engaged``; the caller holds the table's lock."""
    first_engaged: K | None = None
    for _ in range(min(_SCAN, len(table) - 1)):  # never as far as the newest, just added
        key, handle = next(iter(table.items()))
        if handle.at_rest(now):
            del table[key]
            count(f"{counter}.evicted")
            return
        if first_engaged is None:
            first_engaged = key
        table.move_to_end(key)  # engaged: kept, and looked at last next time
    if first_engaged is not None:
        del table[first_engaged]
        count(f"{counter}.evicted-engaged")

