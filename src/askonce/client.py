"""The client shell for calls to another process: one loop shared by the httpx, requests and gRPC clients.

An integration describes one outgoing call as an :class:`Exchange` (send an attempt with a header, judge
what came back, discard a failed attempt's response) and hands it to :meth:`Caller.call` or ``acall``.
Every decision is :class:`~askonce.core.retry.RetryState`'s; the loop (``_flow``) is a generator that
yields the I/O it needs, so the sync and async callers share it line for line::

    bind or mint the question -> deposit in the target's bucket -> start
    per attempt: breaker allows? -> hold the budget (forward) -> header -> send -> judge
      answer:   on_success settles the budget from the reply -> return the response
      failure:  on_failure -> Acquire (bucket) -> Wait (discard the response, sleep) -> resume
      give-up:  return the last response with the reply attached; with none, raise ``errors.error_for``

Without a breaker, the first attempt runs straight (``Caller.call``: no generator, no state object; the
core's ``fits`` and ``settle`` decide it, as ``RetryState.start`` and ``on_success`` would), and the loop
takes over, with a ``RetryState`` holding what the first attempt forwarded, only if it did not answer.
Most calls answer at once, and they are what the overhead is measured on.

A returned give-up carries ``response.askonce_reply``, and every give-up is recorded for
:func:`last_reply`: a server middleware reads it (inside :func:`replies`) to pass a downstream
do-not-retry on even when the handler turned the downstream error into a response of its own.
"""

from __future__ import annotations

import inspect
import random as _random
import time
from collections.abc import Awaitable, Callable, Generator
from dataclasses import replace
from functools import partial
from typing import Any, NamedTuple, Protocol, TypeVar, cast

from askonce import context
from askonce.client_policy import (
    DEFAULT_RETRY,
    IDEMPOTENT_METHODS,
    LOST_OUTCOME,
    MAX_RETRY_AFTER,
    REFUSED_OUTCOME,
    ClientPolicy,
    Outcome,
    is_idempotent,
    judge_http,
    judge_reply,
    parse_retry_after,
    read_reply,
    reply_from,
)
from askonce.client_replies import (
    Record,
    _attach,
    _note,
    last_reply,
    record_replies,
    recording,
    replies,
    stop_recording,
)
from askonce.context import _frame
from askonce.core.breaker import BreakerPolicy
from askonce.core.question import Account, Hop, Tab
from askonce.core.retry import (
    ANSWERED,
    LOST,
    Acquire,
    Attempt,
    Failure,
    GiveUp,
    RetryState,
    Sent,
    Wait,
    attempt_window,
    fits,
    settle,
)
from askonce.core.wire import format_question
from askonce.errors import CircuitOpen, error_for
from askonce.stores.base import AsyncBreakerHandle, AsyncBucketHandle, AsyncStore, BreakerHandle, BucketHandle, Store

__all__ = [
    "AsyncExchange",
    "Caller",
    "ClientPolicy",
    "DEFAULT_POLICY",
    "DEFAULT_RETRY",
    "Exchange",
    "IDEMPOTENT_METHODS",
    "LOST_OUTCOME",
    "MAX_RETRY_AFTER",
    "Outcome",
    "REFUSED_OUTCOME",
    "Record",
    "is_idempotent",
    "judge_http",
    "judge_reply",
    "last_reply",
    "parse_retry_after",
    "read_reply",
    "record_replies",
    "recording",
    "replies",
    "reply_from",
    "stop_recording",
]

R = TypeVar("R")
T = TypeVar("T")

DEFAULT_POLICY = ClientPolicy()

# --- the integration's side of one call ------------------------------------------------------------


class Exchange(Protocol[R]):
    """One outgoing call as the caller drives it (sync). ``timeout``: the framework's own per-attempt
    timeout (for HTTP, the read timeout) or ``None``."""

    @property
    def timeout(self) -> float | None: ...

    def send(self, header: str, timeout: float | None) -> R:
        """One attempt with ``askonce-question: header``, every timeout capped at ``timeout``."""

    def judge(self, response: R) -> Outcome: ...

    def judge_error(self, error: Exception) -> Outcome | None:
        """A transport failure's outcome, or ``None``: not one (it is re-raised unchanged)."""

    def discard(self, response: R) -> None:
        """Release a failed attempt's response (read a little so the connection is reused, then close)."""


class AsyncExchange(Protocol[R]):
    @property
    def timeout(self) -> float | None: ...

    async def send(self, header: str, timeout: float | None) -> R: ...

    def judge(self, response: R) -> Outcome: ...

    def judge_error(self, error: Exception) -> Outcome | None: ...

    async def discard(self, response: R) -> None: ...


def _now(value: T | Awaitable[T]) -> T:
    if inspect.isawaitable(value):
        close = getattr(value, "close", None)
        if close is not None:
            close()  # a coroutine never awaited would warn at garbage collection
        raise TypeError("this store's handles are async: use Caller.acall (an async client)")
    return value


Step = Callable[[], object]
"""One piece of I/O a call asks for: send, sleep, discard, or a store handle's method (maybe async)."""


def _raise(state: RetryState, breaker: Any, give_up: GiveUp, last: BaseException | None) -> BaseException:
    """The exception for a give-up with no response to return."""
    _note(give_up.reply)
    err = error_for(give_up, last, layer=state.layer, key=state.tab.key, attempts=state.attempt)
    if isinstance(err, CircuitOpen) and breaker is not None:
        err.retry_at = breaker.retry_at()
    if err is not last:
        err.__cause__ = last
    return err


class _Call:
    """One call's setup, shared by the first-attempt fast path and the general loop (``_flow``)."""

    __slots__ = ("bucket", "exchange", "first", "idempotent", "path", "sent", "tab", "target")

    def __init__(self, caller: Caller, exchange: Exchange[R] | AsyncExchange[R], target: str, idempotent: bool,
                 now: float) -> None:
        policy = caller.policy
        frame = _frame.get()
        if frame is None:  # each call with nothing bound is a question of its own
            retry = policy.retry
            self.tab = Tab(context.new_key(), policy.layer, policy.originator, Account(retry.budget),
                           None if retry.deadline is None else now + retry.deadline)
            self.path: tuple[Hop, ...] = ()
        else:
            self.tab, self.path = frame
        self.exchange = exchange
        self.target = target
        self.idempotent = idempotent
        self.first = self.path + caller._first
        self.sent: Sent | None = None  # the fast first attempt's window (RetryState.sent), with a grace
        self.bucket: BucketHandle | AsyncBucketHandle | None = (
            None if policy.bucket is None else caller.store.bucket(target, policy.bucket))
        if self.bucket is not None:
            self.bucket.deposit()

    def limit(self, policy: ClientPolicy, now: float) -> float | None:
        """An attempt waits no longer than its own timeout, the policy's, and the question's deadline."""
        limit = self.exchange.timeout
        cap = policy.attempt_timeout
        if cap is not None and (limit is None or cap < limit):
            limit = cap
        deadline = self.tab.deadline
        if deadline is not None:
            left = max(0.0, deadline - now)
            if limit is None or left < limit:
                limit = left
        return limit

    def state(self, caller: Caller, held: int) -> RetryState:
        """The core's state of this call after a first attempt sent with ``held`` forwarded."""
        state = RetryState(caller._policies[self.idempotent], self.tab, caller.policy.layer, self.bucket is not None)
        state.held = held  # what state.forward() would have held
        state.sent = self.sent  # what state.given() would have noted
        return state

    def failed(self, caller: Caller, held: int, exc: BaseException) -> _First | None:
        """The fast first attempt raised: where the general loop goes on from, or ``None`` to re-raise.

        What is not a transport failure is settled as sent-and-lost (fail closed), as ``_flow`` does.
        """
        outcome = self.exchange.judge_error(exc) if isinstance(exc, Exception) else None
        state = self.state(caller, held)
        if outcome is None:
            state.on_failure(Failure(retryable=False, delivery=LOST), caller.clock(), 0.0)
            return None
        return _First(state, None, outcome, exc)

    def answered(self, caller: Caller, held: int, response: Any) -> _First | None:
        """The fast first attempt came back: ``None`` if it is the answer (settled), else where to go on."""
        outcome = self.exchange.judge(response)
        if outcome.failure is None:
            settle(self.tab.account, held, ANSWERED, outcome.reply)  # what RetryState.on_success settles
            return None
        return _First(self.state(caller, held), response, outcome, None)


class _First(NamedTuple):
    """The first attempt as the fast path made it, handed to the general loop when it did not answer."""

    state: RetryState
    response: Any
    outcome: Outcome
    last: BaseException | None


def _flow(caller: Caller, call: _Call, sleep: Callable[[float], object],
          first: _First | None = None) -> Generator[Step, object, Any]:
    """One call, as a generator that does no I/O itself: it yields :data:`Step` thunks and receives their
    results (or has their exceptions thrown in), so the sync and async callers share every line of it.

    ``first``: the first attempt, already made by the fast path (no breaker), that did not answer."""
    policy, clock, exchange, bucket = caller.policy, caller.clock, call.exchange, call.bucket
    breaker: BreakerHandle | AsyncBreakerHandle | None = (
        None if caller._breakers is None or policy.breaker is None else caller._breakers(call.target, policy.breaker))
    started = 0.0
    response: Any = None
    if first is None:
        state = call.state(caller, 0)
        action: Attempt | Wait | Acquire | GiveUp = state.start(clock())
        last: BaseException | None = None
    else:
        state, response, outcome, last = first
    while True:
        if first is None:
            if type(action) is not Attempt:
                raise _raise(state, breaker, cast(GiveUp, action), last)
            now = started = clock()
            if breaker is not None and not (yield partial(breaker.allow, now)):
                raise _raise(state, breaker, state.breaker_open(now, breaker.retry_at()), last)
            limit = call.limit(policy, now)
            forwarded = state.given(limit, policy.deadline_grace, now)
            try:
                header = context.question_header((call.tab, (*call.path, action.hop)), now, forwarded,
                                                 state.forward())
            except BaseException:  # not sent: what forward() held goes back, and the breaker's slot
                state.unsent()
                if breaker is not None:
                    yield partial(breaker.release, clock())
                raise
            response = None
            try:
                response = yield partial(exchange.send, header, limit)
            except BaseException as exc:
                judged = exchange.judge_error(exc) if isinstance(exc, Exception) else None
                if judged is None:  # not a transport failure: settle as lost (fail closed), pass it on
                    state.on_failure(Failure(retryable=False, delivery=LOST), clock(), 0.0)
                    if breaker is not None and not isinstance(exc, GeneratorExit):
                        yield partial(breaker.release, clock())
                    raise
                outcome, last = judged, exc
            else:
                outcome, last = exchange.judge(response), None
        first = None
        now = clock()
        if breaker is not None:
            if outcome.health is None:
                yield partial(breaker.release, now)
            else:
                yield partial(breaker.record, now, success=outcome.health, duration=now - started)
        if outcome.failure is None:
            state.on_success(outcome.reply, ANSWERED)
            return response
        action = state.on_failure(outcome.failure, now, caller.random())
        if type(action) is Acquire:
            action = state.acquired(bucket is not None and bool((yield partial(bucket.withdraw, now))), now)
        if type(action) is GiveUp:
            if response is None:
                raise _raise(state, breaker, action, last)
            _note(action.reply)
            _attach(response, action.reply)
            return response
        if response is not None:  # committed to a retry: release the connection now, not after the wait
            yield partial(exchange.discard, response)
        if cast(Wait, action).seconds > 0:
            yield partial(sleep, cast(Wait, action).seconds)
        action = state.resume(clock())


class Caller:
    """Runs outgoing calls under one :class:`ClientPolicy`; one per client (transport, adapter, channel).

    ``store``: where per-target buckets and breakers live (the process's memory store by default);
    ``clock``, ``sleep``, ``random``: injectable for tests and simulation. ``sleep`` may return an
    awaitable in the async form (the default there is ``asyncio.sleep``).

    ``per_target``: whether calls need their ``target`` at all (a bucket or a breaker is configured).
    """

    __slots__ = ("_breakers", "_first", "_policies", "_sleep", "clock", "per_target", "policy", "random", "store")

    def __init__(
        self,
        policy: ClientPolicy = DEFAULT_POLICY,
        *,
        store: Store | AsyncStore | None = None,
        clock: Callable[[], float] | None = None,
        sleep: Callable[[float], object] | None = None,
        random: Callable[[], float] | None = None,
    ) -> None:
        if not isinstance(policy, ClientPolicy):
            raise ValueError(f"policy must be an askonce.client.ClientPolicy, got {type(policy).__name__}")
        for name, fn in (("clock", clock), ("sleep", sleep), ("random", random)):
            if fn is not None and not callable(fn):
                raise ValueError(f"{name} must be a callable or None, got {fn!r}")
        for kind in ("bucket", "breaker"):  # only what the policy will ask of it
            if store is not None and getattr(policy, kind) is not None and not callable(getattr(store, kind, None)):
                raise ValueError(f"store must be an askonce store (a {kind}(target, policy) method), got {store!r}")
        from askonce.retrying import default_store  # the one store `@askonce.retry` layers share

        self.policy = policy
        self.store: Store | AsyncStore = store if store is not None else default_store()
        self.clock = clock or context.monotonic
        self.random = random or _random.random
        self._sleep = sleep
        # A store without breakers is refused now rather than at the first call.
        self._breakers: Callable[[str, BreakerPolicy], BreakerHandle | AsyncBreakerHandle] | None = None
        if policy.breaker is not None:
            self._breakers = getattr(self.store, "breaker", None)
            if self._breakers is None:
                raise ValueError(f"breaker= needs a store with circuit breakers; {type(self.store).__name__} has none")
        # Indexed by the request's idempotency; a RetryPolicy(idempotent=False) makes every call unsafe.
        self._policies = (replace(policy.retry, idempotent=False), policy.retry)
        self._first = (Hop(policy.layer, 1),)
        self.per_target = policy.bucket is not None or policy.breaker is not None  # else any target will do

    def _start(self, exchange: Exchange[R] | AsyncExchange[R], target: str,
               idempotent: bool) -> tuple[_Call, float | None, int, str] | _Call:
        """Set a call up; with the fast path open, also the first attempt's limit, held budget and header."""
        now = self.clock()
        call = _Call(self, exchange, target, idempotent, now)
        if self._breakers is not None or not fits(self.policy.retry, call.tab.deadline, now):
            return call  # the general loop from the start: the breaker, or the give-up, is the core's to decide
        limit = call.limit(self.policy, now)
        forwarded, call.sent = attempt_window(limit, self.policy.deadline_grace, call.tab.deadline, now)
        account = call.tab.account
        held = account.hold(account.left)  # what RetryState.forward() holds
        tab = call.tab  # the limit already holds the deadline: what context.question_header would send
        try:
            header = format_question(tab.key, tab.origin, tab.edge, held, forwarded, call.first, tab.sig)
        except BaseException:  # nothing was sent (a key minter that failed, say): what was held goes back
            account.release(held)
            raise
        return call, limit, held, header

    def call(self, exchange: Exchange[R], *, target: str, idempotent: bool = True) -> R:
        """Run one call to ``target`` (the key of its bucket and breaker) until answered or given up."""
        sleep = self._sleep or time.sleep
        started = self._start(exchange, target, idempotent)
        if type(started) is _Call:
            return cast(R, _drive(_flow(self, started, sleep)))
        call, limit, held, header = cast(tuple[_Call, float | None, int, str], started)
        try:
            response = exchange.send(header, limit)
        except BaseException as exc:
            first = call.failed(self, held, exc)
            if first is None:
                raise
        else:
            first = call.answered(self, held, response)
            if first is None:
                return response
        return cast(R, _drive(_flow(self, call, sleep, first)))

    async def acall(self, exchange: AsyncExchange[R], *, target: str, idempotent: bool = True) -> R:
        """The async form of :meth:`call`; the store's handles may be sync or async."""
        import asyncio  # only for async clients: `import askonce.client` stays asyncio-free

        sleep = self._sleep or asyncio.sleep
        started = self._start(exchange, target, idempotent)
        if type(started) is _Call:
            return cast(R, await _adrive(_flow(self, started, sleep)))
        call, limit, held, header = cast(tuple[_Call, float | None, int, str], started)
        try:
            response = await exchange.send(header, limit)
        except BaseException as exc:
            first = call.failed(self, held, exc)
            if first is None:
                raise
        else:
            first = call.answered(self, held, response)
            if first is None:
                return response
        return cast(R, await _adrive(_flow(self, call, sleep, first)))


def _drive(flow: Generator[Step, object, Any]) -> Any:
    value: object = None
    error: BaseException | None = None
    while True:
        try:
            step = flow.send(value) if error is None else flow.throw(error)
        except StopIteration as done:
            return done.value
        try:
            value, error = _now(step()), None
        except BaseException as exc:
            value, error = None, exc


async def _adrive(flow: Generator[Step, object, Any]) -> Any:
    value: object = None
    error: BaseException | None = None
    while True:
        try:
            step = flow.send(value) if error is None else flow.throw(error)
        except StopIteration as done:
            return done.value
        try:
            result = step()
            value, error = (await result if inspect.isawaitable(result) else result), None
        except BaseException as exc:
            value, error = None, exc
