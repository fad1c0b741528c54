"""The in-memory store: per-target retry token buckets and circuit breakers shared by this process.

Deposits (one per first attempt) take no lock: a deposit lost to a thread race only makes the bucket
more conservative. Withdrawals, which decide whether a retry happens, are made under a lock, and so is
every breaker operation (the core breaker holds no lock of its own). The number of targets is bounded;
past it the least recently created bucket or breaker is dropped (counted as ``store.memory.evicted``),
so a caller that keys by unbounded names cannot grow memory without end.

A breaker handle reports its state changes to listeners (``add_listener``); they run after the lock is
released, so a listener may call back into the breaker, and a listener that raises is counted
(``breaker.listener.error``), never passed on to the call that happened to cause the change.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

from askonce.context import count
from askonce.core.breaker import Breaker, BreakerPolicy, State, Transition
from askonce.core.bucket import BucketPolicy, TokenBucket

__all__ = ["BreakerHandle", "BucketHandle", "Listener", "MemoryStore"]

Listener = Callable[[str, Transition], object]
"""Called as ``listener(target, transition)`` after a breaker changed state."""

H = TypeVar("H")
K = TypeVar("K")
_CLOSED = State.CLOSED


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

    Satisfies ``stores.base.BreakerHandle``. The hot path (closed breaker, success) is one attribute
    read and one locked core ``record``. Transitions are drained when the state differs from the last
    one seen: an ``allow``/``record``/``state`` call that changed anything ends in another state than it
    started in (an open-elapsed tick ends half-open, and nothing it can do next reverts that).
    ``force_open`` can go open -> half-open -> open in one call, so the rarely used ``_run`` operations
    always drain.
    """

    __slots__ = ("_breaker", "_listeners", "_lock", "_seen", "policy", "target")

    def __init__(self, target: str, policy: BreakerPolicy) -> None:
        self.target = target
        self.policy = policy
        self._breaker = Breaker(policy)
        self._lock = threading.Lock()
        self._seen = State.CLOSED
        self._listeners: tuple[Listener, ...] = ()

    def add_listener(self, listener: Listener) -> None:
        with self._lock:
            if listener not in self._listeners:
                self._listeners = (*self._listeners, listener)

    def remove_listener(self, listener: Listener) -> None:
        with self._lock:
            self._listeners = tuple(x for x in self._listeners if x != listener)

    def _changed(self) -> list[Transition]:
        # Called under the lock when the state moved; the core keeps the transitions until drained.
        self._seen = self._breaker.state
        return self._breaker.drain_transitions()

    def allow(self, now: float) -> bool:
        if self._seen is _CLOSED:
            # Lock-free: a closed breaker admits every call, and it leaves CLOSED only inside record()
            # or force_open(), which update _seen before releasing the lock. Reading a closed state just
            # before another thread opens it is the same as having been called just before.
            return True
        breaker = self._breaker
        with self._lock:
            ok = breaker.allow(now)
            if breaker.state is self._seen:
                return ok
            moved = self._changed()
        notify(self._listeners, self.target, moved)
        return ok

    def record(self, now: float, *, success: bool, duration: float = 0.0) -> None:
        breaker = self._breaker
        with self._lock:
            breaker.record(now, success=success, duration=duration)
            if breaker.state is self._seen:
                return
            moved = self._changed()
        notify(self._listeners, self.target, moved)

    def release(self, now: float) -> None:
        self._run(Breaker.release, now)

    def force_open(self, now: float) -> None:
        self._run(Breaker.force_open, now)

    def force_closed(self, now: float) -> None:
        self._run(Breaker.force_closed, now)

    def _run(self, op: Callable[[Breaker, float], object], now: float) -> None:
        breaker = self._breaker
        with self._lock:
            op(breaker, now)
            moved = self._changed()
        notify(self._listeners, self.target, moved)

    def retry_at(self) -> float | None:
        with self._lock:
            return self._breaker.retry_at()

    def state(self, now: float) -> State:
        breaker = self._breaker
        with self._lock:
            state = breaker.state_at(now)
            if state is self._seen:
                return state
            moved = self._changed()
        notify(self._listeners, self.target, moved)
        return state

    def snapshot(self) -> dict[str, object]:
        with self._lock:
            return self._breaker.snapshot()


class MemoryStore:
    """Process-local state: satisfies ``stores.base.Store``. ``clock`` gives a new bucket its start time."""

    def __init__(self, clock: Callable[[], float], max_targets: int = 4096) -> None:
        if max_targets < 1:
            raise ValueError("max_targets must be at least 1")
        self._clock = clock
        self._max = max_targets
        self._lock = threading.Lock()
        self._buckets: OrderedDict[tuple[str, BucketPolicy], BucketHandle] = OrderedDict()
        self._breakers: OrderedDict[tuple[str, BreakerPolicy], BreakerHandle] = OrderedDict()

    def bucket(self, target: str, policy: BucketPolicy) -> BucketHandle:
        key = (target, policy)
        handle = self._buckets.get(key)
        if handle is not None:
            return handle
        return self._add(self._buckets, key, lambda: BucketHandle(target, TokenBucket(policy, self._clock()),
                                                                   self._lock))

    def breaker(self, target: str, policy: BreakerPolicy) -> BreakerHandle:
        key = (target, policy)
        handle = self._breakers.get(key)
        if handle is not None:
            return handle
        return self._add(self._breakers, key, lambda: BreakerHandle(target, policy))

    def _add(self, table: OrderedDict[K, H], key: K, make: Callable[[], H]) -> H:
        with self._lock:
            handle = table.get(key)
            if handle is None:
                handle = table[key] = make()
                if len(table) > self._max:
                    table.popitem(last=False)
                    count("store.memory.evicted")
            return handle

