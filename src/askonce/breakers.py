"""Circuit breakers by target: a registry, transition callbacks, and a guard to use one on its own.

::

    registry = askonce.breakers.BreakerRegistry()  # in memory; or BreakerRegistry(RedisStore(url))
    registry.on_transition(
        lambda target, t: log.info("%s %s -> %s (%s)", target, t.old, t.new, t.reason))
    payments = registry.get("payments")
    with payments.guard():  # raises CircuitOpen while open
        call_payments()
    payments.call(call_payments)  # the same, without the with protocol's cost

A registry holds one breaker per target, named as the user names it (a host, a service, an
operation), over a store's breaker handles: in memory they are per process, in Redis they are shared
by the fleet. ``registry_for(store)`` gives the one registry of a store (so callbacks registered
there see every breaker of that store); ``default_registry()`` is the one of the default in-memory
store. A registry holds at most ``max_targets`` breakers; past it the oldest one at rest (closed,
no failure in its window) is dropped, so that a flood of new target names (hostnames from webhooks)
cannot push out an open or half-open breaker; only when every breaker looked at is engaged does the
oldest go (``breakers.registry.evicted`` / ``breakers.registry.evicted-engaged``, as the memory
store does).

What a failed call says about the target is ``is_failure``'s business: an exception carrying a
do-not-retry reply with reason ``overloaded`` counts, and so does a 429 or a 408; a client's own
4xx, any other do-not-retry reason (the question ran out of budget or time, an inner breaker is
open), and a cancellation are no verdict on the target and only free the call's probe slot
(``release``).

While a breaker is open the guard raises :class:`askonce.errors.CircuitOpen` at once, with
``retry_at`` (the caller's monotonic clock) and a reply that tells the caller upstream not to retry
(reason ``breaker-open``, pushback until ``retry_at``), carrying the bound question's remaining
budget.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Generator
from functools import partial
from types import TracebackType
from typing import Any, Generic, ParamSpec, TypeVar
from weakref import WeakKeyDictionary

from askonce import _context, _stats
from askonce._loop import ATTEMPT, IO, Step, aadvance, advance, no_sleep
from askonce._stats import count
from askonce.core import is_int
from askonce.core.breaker import BreakerPolicy, State, Transition
from askonce.core.wire import Reply
from askonce.errors import CircuitOpen
from askonce.stores import default_store
from askonce.stores.base import AsyncBreakerHandle, AsyncStore, BreakerHandle, Store
from askonce.stores.memory import Listener, MemoryStore, evict
from askonce.verdict import is_failure

__all__ = [
    "AsyncBreakerRegistry",
    "AsyncCircuitBreaker",
    "BreakerRegistry",
    "CircuitBreaker",
    "Listener",
    "default_registry",
    "is_failure",
    "open_error",
    "registry_for",
]

_DEFAULT_POLICY = BreakerPolicy()
P = ParamSpec("P")
R = TypeVar("R")
H = TypeVar("H", BreakerHandle, AsyncBreakerHandle)


def open_error(target: str, now: float, retry_at: float | None) -> CircuitOpen:
    """The error for a call an open breaker refused, with the reply the caller passes upstream."""
    frame = _context.current_frame()
    left = frame[0].account.left if frame is not None else 0
    key = frame[0].key if frame is not None else None
    layer = frame[1][-1].layer if frame is not None and frame[1] else target
    pushback = None if retry_at is None else max(0.0, retry_at - now)
    reply = Reply(left, True, "breaker-open", pushback)
    when = "" if retry_at is None else f"; next probe in {pushback:.3f} s"
    return CircuitOpen(f"{layer}: circuit breaker for {target!r} is open{when}", reply=reply,
                       layer=layer, key=key, attempts=0, retry_at=retry_at)


def _through(b: CircuitBreaker | AsyncCircuitBreaker,
             now: float | None) -> Generator[Step, BaseException | None, None]:
    """One call through ``b`` as the one loop's steps: ``CircuitOpen`` while open, else the call
    (sent back: the exception it raised, or ``None``) and its verdict: a success, a failure, or
    none."""
    start = b.clock() if now is None else now
    handle: Any = b.handle
    if not (yield IO, partial(handle.allow, start)):
        raise open_error(b.target, start, handle.retry_at())
    exc = yield ATTEMPT, None
    end = max(start, b.clock())  # a clock that stepped back: no negative durations
    if exc is None:
        yield IO, partial(handle.record, end, success=True, duration=end - start)
    elif _judged_failure(b.is_failure, exc):
        yield IO, partial(handle.record, end, success=False, duration=end - start)
    else:
        yield IO, partial(handle.release, end)


def _judged_failure(judge: Callable[[BaseException], bool], exc: BaseException) -> bool:
    """``is_failure(exc)``; one that raises judges a failure (counted): the slot must be settled."""
    try:
        return bool(judge(exc))
    except Exception:
        count("breaker.is-failure.error")
        return True


class _Guard:
    """One call through a breaker: ``with`` (a sync handle) or ``async with`` (either kind)."""

    __slots__ = ("_breaker", "_loop", "_now")

    def __init__(self, breaker: CircuitBreaker | AsyncCircuitBreaker, now: float | None) -> None:
        self._breaker = breaker
        self._now = now

    def __enter__(self) -> _Guard:
        self._loop = _through(self._breaker, self._now)
        advance(self._loop, None, no_sleep)
        return self

    def __exit__(self, t: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        advance(self._loop, exc, no_sleep)

    async def __aenter__(self) -> _Guard:
        self._loop = _through(self._breaker, self._now)
        await aadvance(self._loop, None, no_sleep)
        return self

    async def __aexit__(self, t: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await aadvance(self._loop, exc, no_sleep)


class _Breaker(Generic[H]):
    """What the sync and the async breaker share: the target, its store handle, the judge."""

    __slots__ = ("clock", "handle", "is_failure", "policy", "target")
    handle: H

    def __init__(self, target: str, handle: H, policy: BreakerPolicy, *,
                 clock: Callable[[], float], is_failure: Callable[[BaseException], bool]) -> None:
        self.target = target
        self.handle = handle
        self.policy = policy
        self.clock = clock
        self.is_failure = is_failure

    def at_rest(self, now: float) -> bool:
        """For the registry's eviction: forgetting this breaker loses nothing, as its handle says
        (closed, no failure in its window); a handle that cannot say is taken to be at rest."""
        at_rest = getattr(self.handle, "at_rest", None)
        return at_rest is None or bool(at_rest(now))


class CircuitBreaker(_Breaker[BreakerHandle]):
    """One target's breaker over a sync store handle (memory or Redis)."""

    __slots__ = ()

    def guard(self, now: float | None = None) -> _Guard:
        """``with breaker.guard(): call()``: raises ``CircuitOpen`` while open, records the
        outcome."""
        return _Guard(self, now)

    def call(self, fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
        """``fn(*args, **kwargs)`` through the breaker, as ``with breaker.guard(): fn(...)`` does.

        Raises ``CircuitOpen`` (without calling ``fn``) while open; otherwise returns what ``fn``
        returns, or lets its exception through after recording it as ``is_failure`` says.
        """
        loop = _through(self, None)
        advance(loop, None, no_sleep)
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            advance(loop, exc, no_sleep)
            raise
        advance(loop, None, no_sleep)
        return result

    def state(self, now: float | None = None) -> State:
        return self.handle.state(self.clock() if now is None else now)

    def retry_at(self) -> float | None:
        return self.handle.retry_at()


class AsyncCircuitBreaker(_Breaker[AsyncBreakerHandle]):
    """One target's breaker over an asyncio store handle (``AsyncRedisStore``)."""

    __slots__ = ()

    def guard(self, now: float | None = None) -> _Guard:
        """``async with breaker.guard(): await call()``."""
        return _Guard(self, now)

    async def call(self, fn: Callable[P, Awaitable[R]], /, *args: P.args, **kwargs: P.kwargs) -> R:
        """``await fn(*args, **kwargs)`` through the breaker, as ``async with breaker.guard()``."""
        loop = _through(self, None)
        await aadvance(loop, None, no_sleep)
        try:
            result = await fn(*args, **kwargs)
        except BaseException as exc:
            await aadvance(loop, exc, no_sleep)
            raise
        await aadvance(loop, None, no_sleep)
        return result

    async def state(self, now: float | None = None) -> State:
        return await self.handle.state(self.clock() if now is None else now)

    def retry_at(self) -> float | None:
        return self.handle.retry_at()


B = TypeVar("B", CircuitBreaker, AsyncCircuitBreaker)


class _Registry(Generic[B]):
    def __init__(self, policy: BreakerPolicy, clock: Callable[[], float] | None,
                 is_failure: Callable[[BaseException], bool], max_targets: int) -> None:
        if not is_int(max_targets) or max_targets < 1:
            raise ValueError(f"max_targets must be an integer of at least 1, got {max_targets!r}")
        if clock is not None and not callable(clock):
            raise ValueError(f"clock must be callable, got {clock!r}")
        if not callable(is_failure):
            raise ValueError(f"is_failure must be callable, got {is_failure!r}")
        self.policy = policy
        self.clock = clock or _stats.monotonic
        self.is_failure = is_failure
        self._max = max_targets
        self._lock = threading.Lock()
        self._breakers: OrderedDict[str, B] = OrderedDict()
        self._callbacks: tuple[Listener, ...] = ()

    def on_transition(self, callback: Listener) -> Listener:
        """Call ``callback(target, transition)`` on every state change; usable as a decorator.

        Callbacks run in the thread (or task) whose call caused the change, after the breaker's lock
        is released. With a Redis store, changes made by other processes arrive with reason
        ``observed`` when this process next looks, and changes of the local fallback with their own
        reasons.
        """
        with self._lock:
            self._callbacks = (*self._callbacks, callback)
        return callback

    def remove_callback(self, callback: Listener) -> None:
        with self._lock:
            self._callbacks = tuple(c for c in self._callbacks if c != callback)

    def _dispatch(self, target: str, transition: Transition) -> None:
        for callback in self._callbacks:
            try:
                callback(target, transition)
            except Exception:
                count("breaker.listener.error")

    def _get(self, target: str, policy: BreakerPolicy | None,
             make: Callable[[BreakerPolicy], B]) -> B:
        breaker = self._breakers.get(target)
        if breaker is None:
            with self._lock:
                breaker = self._breakers.get(target)
                if breaker is None:
                    breaker = self._breakers[target] = make(policy or self.policy)
                    add = getattr(breaker.handle, "add_listener", None)
                    if add is not None:
                        add(self._dispatch)
                    if len(self._breakers) > self._max:  # an engaged breaker outlives idle ones
                        evict(self._breakers, self.clock(), "breakers.registry")
        if policy is not None and policy != breaker.policy:
            raise ValueError(f"breaker {target!r} already exists with another policy "
                             f"({breaker.policy!r})")
        return breaker

    def targets(self) -> list[str]:
        return list(self._breakers)


class BreakerRegistry(_Registry[CircuitBreaker]):
    """Breakers by target over a sync store (default: a new in-memory store)."""

    def __init__(self, store: Store | None = None, *, policy: BreakerPolicy = _DEFAULT_POLICY,
                 clock: Callable[[], float] | None = None,
                 is_failure: Callable[[BaseException], bool] = is_failure,
                 max_targets: int = 4096) -> None:
        super().__init__(policy, clock, is_failure, max_targets)
        if store is not None and not callable(getattr(store, "breaker", None)):
            raise ValueError(f"store must be a store (MemoryStore, RedisStore), got {store!r}")
        self.store: Store = store if store is not None else MemoryStore(self.clock)

    def get(self, target: str, policy: BreakerPolicy | None = None) -> CircuitBreaker:
        """The breaker of ``target`` (made with ``policy`` or the registry's on first use)."""
        return self._get(target, policy, lambda p: CircuitBreaker(
            target, self.store.breaker(target, p), p, clock=self.clock, is_failure=self.is_failure))

    def states(self, now: float | None = None) -> dict[str, State]:
        return {target: breaker.state(now) for target, breaker in list(self._breakers.items())}


class AsyncBreakerRegistry(_Registry[AsyncCircuitBreaker]):
    """Breakers by target over an asyncio store."""

    def __init__(self, store: AsyncStore, *, policy: BreakerPolicy = _DEFAULT_POLICY,
                 clock: Callable[[], float] | None = None,
                 is_failure: Callable[[BaseException], bool] = is_failure,
                 max_targets: int = 4096) -> None:
        super().__init__(policy, clock, is_failure, max_targets)
        if not callable(getattr(store, "breaker", None)):
            raise ValueError(f"store must be an asyncio store (AsyncRedisStore), got {store!r}")
        self.store = store

    def get(self, target: str, policy: BreakerPolicy | None = None) -> AsyncCircuitBreaker:
        return self._get(target, policy, lambda p: AsyncCircuitBreaker(
            target, self.store.breaker(target, p), p, clock=self.clock, is_failure=self.is_failure))


_registries: WeakKeyDictionary[object, BreakerRegistry] = WeakKeyDictionary()
_registries_lock = threading.Lock()


def registry_for(store: Store) -> BreakerRegistry:
    """The one registry of a sync store, made on first use (its callbacks see all its breakers)."""
    with _registries_lock:
        registry = _registries.get(store)
        if registry is None:
            registry = _registries[store] = BreakerRegistry(store)
        return registry


def default_registry() -> BreakerRegistry:
    """The registry of ``@askonce.retry``'s default in-memory store."""
    return registry_for(default_store())
