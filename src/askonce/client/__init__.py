"""The client shell for calls to another process, shared by the httpx, requests and gRPC clients.

An integration describes one outgoing call as an :class:`Exchange` (send an attempt with a header,
judge what came back, discard a failed attempt's response) and hands it to :meth:`Caller.call` or
``acall``. Every decision is :class:`~askonce.core.retry.RetryState`'s, made in the one loop of
:mod:`askonce._loop` that ``@askonce.retry`` runs too; the caller only makes each attempt::

    bind or mint the question -> deposit in the target's bucket -> start
    per attempt: breaker, admission allow? -> hold the budget (forward) -> header -> send -> judge
      answer:   settle the budget from the reply -> return the response
      failure:  on_failure -> Acquire (bucket) -> Wait (discard the response, sleep) -> resume
      give-up:  return the last response with the reply attached; with none, raise

Without a breaker, the first attempt runs straight (no generator, no state object; the core's
``fits`` and ``settle`` decide it, as ``RetryState.start`` and ``on_success`` would, and the
admission controller is asked and told the verdict in place, as the loop would), and the loop takes
over, with a ``RetryState`` holding what the first attempt forwarded, only if it did not answer.
Most calls answer at once, and they are what the overhead is measured on. With a breaker, every
attempt, the first included, goes through the loop: each one must be allowed (an IO step) and
judged.

A returned give-up carries ``response.askonce_reply``, and every give-up is recorded for
:func:`last_reply`: a server middleware reads it (inside :func:`replies`) to pass a downstream
do-not-retry on even when the handler turned the downstream error into a response of its own.
"""

from __future__ import annotations

import random as _random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol, TypeVar, cast

from askonce import _stats, propagation
from askonce._context import FRAME
from askonce._loop import REFUSE, AttemptContext, Pass, Tried, give_up, joined_try, steps
from askonce._replies import (
    Record,
    attach,
    last_reply,
    note,
    record_replies,
    recording,
    replies,
    stop_recording,
)
from askonce.client.following import AsyncFollowing, Following, followable
from askonce.client.hedging import Hedgers, hedgers_for, race
from askonce.client.policy import (
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
from askonce.core.admission import AdmissionPolicy
from askonce.core.breaker import BreakerPolicy
from askonce.core.hedge import FIRST, HEDGE, HedgePolicy, Race
from askonce.core.question import Account, Hop, Tab
from askonce.core.retry import (
    ANSWERED,
    LOST,
    Failure,
    GiveUp,
    RetryState,
    Sent,
    attempt_window,
    fits,
    settle,
)
from askonce.core.wire import Reply, format_question
from askonce.stores import admissions_of, default_store  # the store `@askonce.retry` layers share
from askonce.stores.base import (
    AdmissionHandle,
    AsyncBreakerHandle,
    AsyncBucketHandle,
    AsyncStore,
    BreakerHandle,
    BucketHandle,
    Store,
)

__all__ = [
    "AsyncExchange",
    "Caller",
    "ClientPolicy",
    "DEFAULT_POLICY",
    "DEFAULT_RETRY",
    "Exchange",
    "HedgePolicy",
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
_HANDLES = 256  # admission handles a Caller keeps (Caller._admission); past it, the store is asked

# --- the integration's side of one call -----------------------------------------------------------


class Exchange(Protocol[R]):
    """One outgoing call as the caller drives it (sync). ``timeout``: the framework's own
    per-attempt timeout (for HTTP, the read timeout) or ``None``."""

    @property
    def timeout(self) -> float | None: ...

    def send(self, header: str, timeout: float | None) -> R:
        """One attempt with ``askonce-question: header``, every timeout capped at ``timeout``."""

    def judge(self, response: R) -> Outcome: ...

    def judge_error(self, error: Exception) -> Outcome | None:
        """A transport failure's outcome, or ``None``: not one (it is re-raised unchanged)."""

    def discard(self, response: R) -> bool | None:
        """Release a failed attempt's response (read a little so the connection is reused, then
        close it). ``False``: nothing to release, the response stays whole, and a give-up before
        the next attempt returns it; otherwise such a give-up raises."""


class AsyncExchange(Protocol[R]):
    @property
    def timeout(self) -> float | None: ...

    async def send(self, header: str, timeout: float | None) -> R: ...

    def judge(self, response: R) -> Outcome: ...

    def judge_error(self, error: Exception) -> Outcome | None: ...

    async def discard(self, response: R) -> bool | None: ...


def _end(state: RetryState, action: GiveUp, last: Tried | None, retry_at: float | None) -> None:
    """A give-up: recorded for :func:`last_reply`; the last response is returned with the reply
    attached (``response.askonce_reply``), and with no response the loop's exception is raised."""
    note(action.reply)
    if last is not None and last.response is not None:
        attach(last.response, action.reply)
        return
    give_up(state, action, last, retry_at)


def _answered(exchange: Exchange[R] | AsyncExchange[R], response: R, call: _Call) -> Tried:
    return _judged(exchange.judge(response), response, call)


def _judged(outcome: Outcome, response: Any, call: _Call) -> Tried:
    failure = outcome.failure
    if call.joiners is not None:
        if failure is not None and failure.delivery == LOST:
            # A status the client's own library made (gRPC's deadline): no word from the callee,
            # so nothing is learned of its joining. Toward a callee that joins the try is lost,
            # but its work may go on there, as for a timeout that raised.
            if call.joins:
                failure = replace(failure, joinable=True)
        else:
            call.joiners.heard(call.target, outcome.reply)
    return Tried(failure, outcome.health, outcome.reply, ANSWERED, response=response)


def _raised(exchange: Exchange[R] | AsyncExchange[R], exc: BaseException, call: _Call) -> Tried:
    """An attempt that raised: a transport failure as the exchange judges it (a lost try to a
    target that joins is joinable); anything else is settled as sent-and-lost (fail closed) and
    passed on unchanged."""
    outcome = exchange.judge_error(exc) if isinstance(exc, Exception) else None
    if outcome is None:
        return Tried(Failure(retryable=False, delivery=LOST), None, error=exc, fatal=True)
    failure = outcome.failure
    if failure is not None and failure.delivery == LOST and call.joins:
        failure = replace(failure, joinable=True)
    return Tried(failure, outcome.health, outcome.reply, ANSWERED, error=exc)


def _first_answered(caller: Caller, call: _Call, outcome: Outcome, held: int) -> bool:
    """The fast first attempt's outcome, when it is the answer (``True``): heard, told to the
    admission controller and settled, as ``_answered``, ``_heard`` and ``on_success`` would."""
    if outcome.failure is not None:
        return False
    if call.joiners is not None:
        call.joiners.heard(call.target, outcome.reply)
    if call.admission is not None and outcome.health is not None:
        call.admission.record(caller.clock(), success=outcome.health)
    settle(call.tab.account, held, ANSWERED, outcome.reply)
    return True


def _heard(caller: Caller, call: _Call, tried: Tried) -> None:
    """The fast first attempt's verdict, told to the admission controller that let it through (as
    the loop tells it of the attempts it makes)."""
    if call.admission is not None and tried.health is not None and not joined_try(tried):
        call.admission.record(caller.clock(), success=tried.health)


class Joiners:
    """The targets whose latest reply said they join (``Reply.joins``: a server whose join layer
    has announced itself says it on its own refusals too), at most ``limit`` of them (past it the
    oldest is forgotten: a forgotten target's timed-out tries are lost again until it replies
    once more). One per process (``JOINERS``), shared by every :class:`Caller`."""

    __slots__ = ("_lock", "_seen", "limit")

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self._seen: dict[str, None] = {}
        self._lock = threading.Lock()  # callers on many threads and event loops

    def __contains__(self, target: object) -> bool:
        return target in self._seen

    def __len__(self) -> int:
        return len(self._seen)

    def heard(self, target: str, reply: Reply | None) -> None:
        seen = self._seen
        joins = reply is not None and reply.joins
        if joins == (target in seen):
            return  # the usual case: nothing changes, and no lock is taken
        with self._lock:
            if not joins:
                if seen.pop(target, False) is None:  # it was there: counted, as it changes waits
                    _stats.count("client.joiners.forgot")
            elif target not in seen:
                if len(seen) >= self.limit:
                    seen.pop(next(iter(seen)), None)
                seen[target] = None

    def clear(self) -> None:
        with self._lock:
            self._seen.clear()


# What every Caller of the process has heard: a target's reply to one client is news to all.
JOINERS = Joiners()


class _Call:
    """One call's setup, shared by the first-attempt fast path and the loop."""

    __slots__ = ("admission", "bucket", "delay", "exchange", "first", "follows", "idempotent",
                 "joiners", "joins", "path", "race", "sent", "tab", "target", "whole")

    def __init__(self, caller: Caller, exchange: Exchange[R] | AsyncExchange[R], target: str,
                 idempotent: bool, now: float) -> None:
        policy = caller.policy
        frame = FRAME.get()
        if frame is None:  # each call with nothing bound is a question of its own
            retry = policy.retry
            self.tab = Tab(propagation.new_key(), policy.layer, policy.originator,
                           Account(retry.budget),
                           None if retry.deadline is None else now + retry.deadline)
            self.path: tuple[Hop, ...] = ()
        else:
            self.tab, self.path = frame
        self.exchange = exchange
        self.target = target
        self.idempotent = idempotent
        self.first = self.path + caller._first
        self.sent: Sent | None = None  # the fast first attempt's window (RetryState.sent)
        self.race: Race | None = None  # a first attempt that may hedge, after ``delay`` seconds
        self.delay: float | None = None
        # The admission handle the fast path asked (REFUSE: it refused), else the loop asks it.
        self.admission: AdmissionHandle | None = None
        self.joiners = caller._joiners
        self.joins = self.joiners is not None and target in self.joiners
        # The callee is given the question's whole time left: it joins, or it is asked to answer
        # in async mode (its run outlives the try, and the try comes back for its answer).
        self.follows = policy.respond_async and followable(exchange)
        self.whole = self.joins or self.follows
        self.bucket: BucketHandle | AsyncBucketHandle | None = (
            None if policy.bucket is None else caller.store.bucket(target, policy.bucket))
        if self.bucket is not None:
            self.bucket.deposit()

    def limit(self, policy: ClientPolicy, now: float) -> float | None:
        """An attempt waits at most its own timeout, the policy's, and the question's deadline.
        Toward a callee that joins, the policy's is not applied: the callee answers by the
        deadline it is given, so this layer waits for it instead of timing out into retries."""
        limit = self.exchange.timeout
        # Without a question deadline the callee has none to answer by: the cap stays.
        cap = (None if self.joins and self.tab.deadline is not None
               else policy.attempt_timeout)
        if cap is not None and (limit is None or cap < limit):
            limit = cap
        deadline = self.tab.deadline
        if deadline is not None:
            left = max(0.0, deadline - now)
            if limit is None or left < limit:
                limit = left
        return limit

    def loop(self, caller: Caller, held: int, first: Tried | None,
             sleep: Callable[[float], object], tries: int = 1) -> tuple[RetryState, Pass]:
        """The core's state of this call and the loop over it, after a first attempt sent with
        ``held`` forwarded (``first``; ``tries``: 2 when it was hedged), or from the start."""
        state = RetryState(caller._policies[self.idempotent], self.tab, caller.policy.layer,
                           self.bucket is not None)
        state.held = held  # what state.forward() would have held
        state.attempt = tries  # a hedge was this layer's second try: a retry is its third
        state.sent = self.sent  # what state.given() would have noted
        policy, exchange = caller.policy, self.exchange
        breaker = None
        admission = self.admission
        if caller._breakers is not None and policy.breaker is not None:
            breaker = caller._breakers(self.target, policy.breaker)
        if (admission is None and caller._admissions is not None
                and policy.admission is not None):
            admission = caller._admission(self.target)
        loop = steps(state, clock=caller.clock, random=caller.random, bucket=self.bucket,
                     breaker=breaker, end=_end, first=first, discard=exchange.discard,
                     admission=admission)
        return state, Pass(loop, (self.tab, self.path), _no_block, sleep)

    def header(self, caller: Caller, state: RetryState,
               attempt: AttemptContext) -> tuple[float | None, str] | Tried:
        """Before an attempt: its limit and header, holding the budget it forwards; if the header
        cannot be built, nothing is sent and what was held goes back."""
        now = caller.clock()
        limit = self.limit(caller.policy, now)
        forwarded = state.given(limit, caller.policy.deadline_grace, now, self.whole)
        try:
            header = propagation.question_header(attempt.frame, now, forwarded, state.forward(),
                                                 state.rejoin)
            return limit, header
        except BaseException as exc:
            state.unsent()
            return Tried(Failure(retryable=False), None, error=exc, fatal=True)


# What Caller._start sets up: the call, and its first attempt's limit, held budget and header (no
# header: the loop makes every attempt).
_Started = tuple[_Call, float | None, int, str | None]


def _no_block(exc: BaseException) -> Tried:  # a Caller reports its attempts; it never runs a block
    raise AssertionError("askonce: a client attempt is reported, not run as a block") from exc


class Caller:
    """Runs outgoing calls under one :class:`ClientPolicy`; one per transport, adapter or channel.

    ``store``: where per-target buckets, breakers and admission live (the process's memory store
    by default); ``clock``, ``sleep``, ``random``: injectable for tests and simulation. ``sleep``
    may return an awaitable in the async form (the default there is ``asyncio.sleep``).

    ``per_target``: whether calls need their ``target`` at all (a bucket, breaker or admission is
    configured).
    """

    __slots__ = ("_admissions", "_breakers", "_first", "_follows", "_guarded", "_handles",
                 "_handles_lock", "_handles_seen", "_hedge_hop", "_hedgers", "_joiners", "_owner",
                 "_policies", "_sleep", "clock", "per_target", "policy", "random", "store")

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
            raise ValueError("policy must be an askonce.client.ClientPolicy, "
                             f"got {type(policy).__name__}")
        for name, fn in (("clock", clock), ("sleep", sleep), ("random", random)):
            if fn is not None and not callable(fn):
                raise ValueError(f"{name} must be a callable or None, got {fn!r}")
        # A store must have what the policy will ask of it, and be a store at all.
        has = {k: callable(getattr(store, k, None)) for k in ("bucket", "breaker")}
        for kind in ("bucket", "breaker"):
            wanted = getattr(policy, kind) is not None or not any(has.values())
            if store is not None and wanted and not has[kind]:
                raise ValueError(f"store must be an askonce store (a {kind}(target, policy) "
                                 f"method), got {store!r}")
        self.policy = policy
        self.store: Store | AsyncStore = store if store is not None else default_store()
        self.clock = clock or _stats.monotonic
        self.random = random or _random.random
        self._sleep = sleep
        # A store without breakers is refused now rather than at the first call.
        self._breakers: Callable[[str, BreakerPolicy],
                                 BreakerHandle | AsyncBreakerHandle] | None = None
        if policy.breaker is not None:
            self._breakers = getattr(self.store, "breaker", None)
            if self._breakers is None:
                raise ValueError("breaker= needs a store with circuit breakers; "
                                 f"{type(self.store).__name__} has none")
        self._admissions: Callable[[str, AdmissionPolicy], AdmissionHandle] | None = None
        if policy.admission is not None:
            # A store of your own without admission handles: this process's memory store's.
            self._admissions = admissions_of(self.store)
        # The admission handles a memory store gave this Caller, by target (the policy is the
        # Caller's own), so that a call does not hash the policy to look its handle up again: at
        # most _HANDLES of them, all dropped once the store has evicted any handle since. Only the
        # memory store's own ``admission`` (a subclass that overrides it is asked every time).
        owner: Any = getattr(self._admissions, "__self__", None)
        memory: Any = sys.modules.get("askonce.stores.memory")  # loaded if owner is one
        keeps = (memory is not None and isinstance(owner, memory.MemoryStore)
                 and type(owner).admission is memory.MemoryStore.admission)
        self._owner = owner
        self._handles: dict[str, AdmissionHandle] | None = {} if keeps else None
        self._handles_seen: int = owner._evicted if keeps else 0
        self._handles_lock = threading.Lock()
        # A breaker is asked about every attempt as an IO step, the first too: no fast path then.
        self._guarded = self._breakers is not None
        # Indexed by idempotency; a RetryPolicy(idempotent=False) makes every call unsafe.
        self._policies = (replace(policy.retry, idempotent=False), policy.retry)
        self._first = (Hop(policy.layer, 1),)
        self._hedge_hop = Hop(policy.layer, 2)
        self._joiners = JOINERS if policy.rejoin else None
        self._hedgers = None if policy.hedge is None else hedgers_for(policy.hedge)
        self._follows = policy.respond_async
        # Without a bucket, a breaker, admission, rejoining or hedging, any target will do.
        self.per_target = (policy.bucket is not None or policy.breaker is not None
                           or policy.admission is not None or policy.rejoin
                           or policy.hedge is not None)

    def _admission(self, target: str) -> AdmissionHandle:
        """The admission handle of ``target`` (``_admissions``), from this Caller's own cache when
        it can be (a memory store's, none evicted since it was kept)."""
        handles, owner = self._handles, self._owner
        if handles is None:
            return cast(Callable[[str, AdmissionPolicy], AdmissionHandle], self._admissions)(
                target, cast(AdmissionPolicy, self.policy.admission))
        if owner._evicted != self._handles_seen:
            with self._handles_lock:
                handles.clear()
                self._handles_seen = owner._evicted
        handle = handles.get(target)
        if handle is None:
            seen = owner._evicted  # read before asking: an eviction meanwhile may have taken it
            handle = owner.admission(target, self.policy.admission)
            with self._handles_lock:  # kept only if the store has evicted nothing since then
                if owner._evicted == seen == self._handles_seen and len(handles) < _HANDLES:
                    handles[target] = handle
        return handle

    def _start(self, exchange: Exchange[R] | AsyncExchange[R], target: str,
               idempotent: bool, hedging: bool = False) -> _Started:
        """Set a call up; with the fast path open, also the first attempt's limit, held budget and
        header (``None``: the loop from the start). ``hedging``: the shell can race a hedge
        (async); if this call may hedge now, one is reserved for it before the first attempt holds
        the rest (``call.race``)."""
        now = self.clock()
        call = _Call(self, exchange, target, idempotent, now)
        if self._guarded or not fits(self.policy.retry, call.tab.deadline, now):
            return call, None, 0, None  # the loop: breaker and admission, or the give-up, decide
        if self._admissions is not None:
            admission = self._admission(target)
            if not admission.admit(now, self.random()):
                call.admission = REFUSE  # the loop gives the refusal up
                return call, None, 0, None
            call.admission = admission
        limit = call.limit(self.policy, now)
        forwarded, call.sent = attempt_window(limit, self.policy.deadline_grace,
                                              call.tab.deadline, now, call.whole)
        account = call.tab.account
        reserved = 0
        hedged = (hedging and self._hedgers is not None and (idempotent or call.joins)
                  and callable(getattr(exchange, "fork", None)))
        if hedged:  # it earns its share of a hedge token, and learns its latency, in any case
            call.delay = cast(Hedgers, self._hedgers).plan(target, now)
            if call.delay is not None:  # one reserved for the hedge (none left: no hedge)
                reserved = account.hold(1)
                call.delay = call.delay if reserved else None
        held = account.hold(account.left)  # what RetryState.forward() holds
        if hedged:
            call.race = Race(account, held, reserved)
        tab = call.tab  # the limit already holds the deadline: what question_header sends
        try:
            header = format_question(tab.key, tab.origin, tab.edge, held, forwarded, call.first,
                                     tab.sig)
        except BaseException:  # nothing was sent (a key minter failed): give back what was held
            account.release(held + reserved)
            raise
        return call, limit, held, header

    def _following(self, call: _Call, exchange: Any, sleep: Callable[[float], object],
                   twin: type[Following[Any]] | type[AsyncFollowing[Any]]) -> Any:
        """The call's exchange, wrapped to follow a 202 to its answer when it asks for async
        mode (``ClientPolicy.respond_async``), else as it is."""
        if not call.follows:
            return exchange
        call.exchange = twin(exchange, call.tab.deadline, self.policy.attempt_timeout, self.clock,
                             sleep)
        return call.exchange

    def call(self, exchange: Exchange[R], *, target: str, idempotent: bool = True) -> R:
        """Run one call to ``target`` (its bucket and breaker key) until answered or given up."""
        sleep = self._sleep or time.sleep
        call, limit, held, header = self._start(exchange, target, idempotent)
        first, response = None, None
        if self._follows:
            exchange = self._following(call, exchange, sleep, Following)
        if header is not None:
            try:
                response = exchange.send(header, limit)
            except BaseException as exc:
                first = _raised(exchange, exc, call)
                _heard(self, call, first)
                if first.fatal:
                    raise  # sent and lost (fail closed): what was held stays spent
            else:
                outcome = exchange.judge(response)
                if _first_answered(self, call, outcome, held):
                    return response
                first = _judged(outcome, response, call)
                _heard(self, call, first)
        state, run = call.loop(self, held, first, sleep)
        for attempt in run:
            sent = call.header(self, state, attempt)
            if type(sent) is Tried:
                attempt.report(sent)
                raise sent.error  # type: ignore[misc]
            limit, header = cast(tuple[float | None, str], sent)
            try:
                response = exchange.send(header, limit)
            except BaseException as exc:
                response, tried = None, _raised(exchange, exc, call)
                attempt.report(tried)
                if tried.fatal:
                    raise
            else:
                attempt.report(_answered(exchange, response, call))
        return cast(R, response)

    async def acall(self, exchange: AsyncExchange[R], *, target: str, idempotent: bool = True) -> R:
        """The async form of :meth:`call`; the store's handles may be sync or async."""
        import asyncio  # only for async clients: `import askonce.client` stays asyncio-free

        sleep = self._sleep or asyncio.sleep
        call, limit, held, header = self._start(exchange, target, idempotent, hedging=True)
        first, response, tries = None, None, 1
        if self._follows:
            exchange = self._following(call, exchange, sleep, AsyncFollowing)
        if header is None:
            pass  # the loop from the start
        elif (race_ := call.race) is not None:
            first, held = await self._hedged(call, race_, exchange, limit, header)
            response = first.response
            if first.fatal:
                raise first.error  # type: ignore[misc]
            if first.failure is None:
                settle(call.tab.account, held, ANSWERED, first.reply)
                return cast(R, first.response)
            tries = 2 if race_.fired else 1
        else:
            try:
                response = await exchange.send(header, limit)
            except BaseException as exc:
                first = _raised(exchange, exc, call)
                _heard(self, call, first)
                if first.fatal:
                    raise  # sent and lost (fail closed): what was held stays spent
            else:
                outcome = exchange.judge(response)
                if _first_answered(self, call, outcome, held):
                    return response
                first = _judged(outcome, response, call)
                _heard(self, call, first)
        state, run = call.loop(self, held, first, sleep, tries)
        async for attempt in run:
            sent = call.header(self, state, attempt)
            if type(sent) is Tried:
                await attempt.areport(sent)
                raise sent.error  # type: ignore[misc]
            limit, header = cast(tuple[float | None, str], sent)
            try:
                response = await exchange.send(header, limit)
            except BaseException as exc:
                response, tried = None, _raised(exchange, exc, call)
                await attempt.areport(tried)
                if tried.fatal:
                    raise
            else:
                await attempt.areport(_answered(exchange, response, call))
        return cast(R, response)

    async def _hedged(self, call: _Call, state: Race, exchange: AsyncExchange[R],
                      limit: float | None, header: str) -> tuple[Tried, int]:
        """A first attempt that may hedge: the race (:func:`askonce.client.hedging.race`), then
        what the call goes on with, and what is still held for it. The hedge is this layer's
        second try (hop ``layer:2``), with the question's key and deadline and no budget."""
        hedgers, target, tab = cast(Hedgers, self._hedgers), call.target, call.tab
        tries: dict[int, AsyncExchange[R]] = {FIRST: exchange}
        sent = self.clock()

        def hedge() -> Any:
            now = self.clock()
            fork: AsyncExchange[R] | None = getattr(exchange, "fork")()  # noqa: B009
            # The token before admission: an admitted request is one that is made.
            if (fork is None or not fits(self.policy.retry, tab.deadline, now)
                    or not hedgers.take(target, now)
                    or (call.admission is not None
                        and not call.admission.admit(now, self.random()))):
                return None
            wait = call.limit(self.policy, now)
            forwarded, _ = attempt_window(wait, self.policy.deadline_grace, tab.deadline, now,
                                          call.whole)
            line = format_question(tab.key, tab.origin, tab.edge, 0, forwarded,
                                   (*call.path, self._hedge_hop), tab.sig)
            state.fire()
            _stats.count("client.hedged")
            tries[HEDGE] = fork
            return fork.send(line, wait)

        def judge(which: int, response: Any, error: BaseException | None) -> Tried:
            one = tries[which]
            tried = (_raised(one, error, call) if error is not None
                     else _answered(one, response, call))
            _heard(self, call, tried)
            hedgers.heard(target, self.clock(), tried.reply)
            return tried

        try:
            which, tried = await race(state, exchange.send(header, limit), call.delay, hedge,
                                      judge, exchange.discard)
        except BaseException:  # cancelled mid-race, or a judge that raised: an unsent hedge's
            if not state.fired and state.reserved:  # reserve goes back (what the first try
                state.account.release(state.reserved)  # forwarded stays spent: fail closed)
                state.reserved = 0
            raise
        held = state.settle(which)
        if tried.failure is None:
            hedgers.observe(target, self.clock() - sent)
        return tried, held
