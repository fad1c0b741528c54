"""The one loop of attempts over :mod:`askonce.core.retry`, and its two drivers.

:func:`steps` is a generator that does no I/O itself. It yields what it needs done and is sent back
the outcome::

    (ATTEMPT, Attempt)   make the attempt; send back a :class:`Tried`
    (IO, thunk)          a store call (a bucket or breaker handle's method; async for asyncio Redis)
    (SLEEP, seconds)     wait before the next attempt

Two drivers perform the IO and SLEEP steps and stop at each attempt: :func:`advance` (sync) and
:func:`aadvance` (async: it awaits whatever returns an awaitable). Whoever holds the driver makes
the attempt its own way: ``@askonce.retry`` and the iterator form run the user's code in
``with attempt:`` (:class:`Pass`), :class:`askonce.client.Caller` sends a request, the simulator
schedules a message. Every decision is :class:`~askonce.core.retry.RetryState`'s.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterator
from contextvars import Token
from functools import partial
from types import CoroutineType, GeneratorType, TracebackType
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from askonce._context import FRAME

if TYPE_CHECKING:
    from typing_extensions import TypeIs

    from askonce.core.breaker import Breaker
    from askonce.core.bucket import TokenBucket
from askonce.core.question import Frame, Hop, Tab
from askonce.core.retry import LOCAL, Acquire, Attempt, Failure, GiveUp, RetryState, Wait
from askonce.core.wire import Reply
from askonce.errors import error_for, failure_of, reply_of
from askonce.stores.base import (
    AdmissionHandle,
    AsyncBreakerHandle,
    AsyncBucketHandle,
    BreakerHandle,
    BucketHandle,
)

T = TypeVar("T")

ATTEMPT, IO, SLEEP = 0, 1, 2
Step = tuple[int, Any]


class Tried(NamedTuple):
    """What one attempt came to, as the shell that made it judged it.

    ``failure``: ``None`` when the attempt is the answer. ``health``: the breaker's verdict on the
    target (``None``: no verdict, the slot is only released). ``reply``: an answer's
    ``askonce-reply``, which settles what was held (``delivery``). ``error``: what the attempt
    raised, kept as the cause of a give-up. ``fatal``: raise ``error`` at once, after settling and
    the breaker's verdict (not an error this layer retries). ``response``: a failed attempt's
    response, returned with a give-up or discarded before the next attempt.
    """

    failure: Failure | None
    health: bool | None
    reply: Reply | None = None
    delivery: str = LOCAL
    error: BaseException | None = None
    fatal: bool = False
    response: Any = None


ANSWER = Tried(None, True)
_NO_WAIT = Wait(0.0)  # the action before a first attempt a fast path made (immutable: shared)


def abandoned() -> Tried:
    """A pass left before its attempt reported (a ``break`` out of the loop): release the slot."""
    return Tried(Failure(retryable=False), None, error=GeneratorExit(), fatal=True)


End = Callable[[RetryState, GiveUp, "Tried | None", "float | None"], None]
Ended = tuple[bool, Reply]  # (answered, the reply for this layer's caller)


def keep(state: RetryState, action: GiveUp, last: Tried | None, retry_at: float | None) -> None:
    """A give-up that raises nothing: the shell reads the loop's return value (the simulator)."""


def give_up(state: RetryState, action: GiveUp, last: Tried | None, retry_at: float | None) -> None:
    """Raise a give-up's exception: askonce's for its limits, the last error for the layer's own."""
    cause = None if last is None else last.error
    err = error_for(action, cause, layer=state.layer, key=state.tab.key, attempts=state.attempt,
                    retry_at=retry_at)
    if err is cause:
        raise err
    raise err from cause


def steps(state: RetryState, *, clock: Callable[[], float], random: Callable[[], float],
          bucket: BucketHandle | AsyncBucketHandle | TokenBucket | None = None,
          breaker: BreakerHandle | AsyncBreakerHandle | Breaker | None = None, end: End = give_up,
          first: Tried | None = None, discard: Callable[[Any], object] | None = None,
          admission: AdmissionHandle | None = None) -> Generator[Step, Any, Ended]:
    """One call's attempts at one layer, from the first (or after ``first``, made by a fast path).

    Per attempt: the breaker and then the admission controller (if any) allow it, the shell
    makes it, both hear the verdict; on failure the state decides (a bucket token when it asks
    for one, the wait), then the next attempt. A give-up goes to ``end`` (which raises, or returns
    to let the shell return a response); an answer ends the loop after settling what was held.
    Returns whether it was answered, and the reply for the caller. The admission controller is
    called in place, never as an IO step: a core ``Admission`` (the simulator's) or a store's
    in-memory handle (``stores.base.AdmissionHandle``). A shell that makes a first attempt itself
    (``first``) has asked the admission controller about it and told it the verdict; a first
    attempt the controller refused is handed over as ``admission=REFUSE``, with no ``first``.
    """
    tried, last = first, None
    action: Attempt | Wait | Acquire | GiveUp = (_NO_WAIT if first is not None
                                                 else state.start(clock()))
    while True:
        if tried is None:
            if type(action) is not Attempt:
                end(state, action, last, None)  # type: ignore[arg-type]
                return False, action.reply  # type: ignore[union-attr]
            started = clock()
            if breaker is not None and not (yield IO, partial(breaker.allow, started)):
                retry_at = breaker.retry_at()
                action = state.breaker_open(started, retry_at)
                end(state, action, last, retry_at)
                return False, action.reply
            # A re-attach joins work already in flight at the callee: it adds none, so admission,
            # which sheds work, neither refuses it nor hears a lost one as the target's failure.
            if admission is not None and not state.rejoin \
                    and not admission.admit(started, random()):
                if breaker is not None:  # free the probe slot the breaker may have given it
                    yield IO, partial(breaker.release, started)
                action = state.refused()
                end(state, action, last, None)
                return False, action.reply
            tried = yield ATTEMPT, action
            if admission is not None and tried.health is not None and not joined_try(tried):
                admission.record(clock(), success=tried.health)
            if breaker is not None:
                done = clock()
                yield IO, (partial(breaker.release, done) if tried.health is None else
                           partial(breaker.record, done, success=tried.health,
                                   duration=done - started))
        now = clock()
        if tried.failure is None:
            return True, state.on_success(tried.reply, tried.delivery)
        action = state.on_failure(tried.failure, now, 0.0 if tried.fatal else random())
        if tried.fatal:
            raise tried.error if tried.error is not None else RuntimeError("askonce: fatal attempt")
        last, tried = tried, None
        if type(action) is Acquire:
            ok = bucket is not None and (yield IO, partial(bucket.withdraw, now))
            action = state.acquired(bool(ok), now)
        if type(action) is GiveUp:
            end(state, action, last, None)
            return False, action.reply
        if discard is not None and last.response is not None:
            kept = yield IO, partial(discard, last.response)
            if kept is not False:  # released (False: nothing to release, the response is whole)
                # A give-up before the next attempt (breaker open, shed, deadline after the wait)
                # must raise, not return a response whose body is gone.
                last = last._replace(response=None)
        if action.seconds > 0:  # type: ignore[union-attr]
            yield SLEEP, action.seconds  # type: ignore[union-attr]
        action = state.resume(clock())


def joined_try(tried: Tried) -> bool:
    """Lost to a callee that joins: the work goes on there, so no verdict on the target's health
    for admission (a try that timed out is re-attached, not run again)."""
    return tried.failure is not None and tried.failure.joinable


class _Refuse:
    """The admission of a first attempt a shell's fast path asked about and was refused: the loop
    gives that refusal up as the controller's (it never asks again, nor records)."""

    __slots__ = ()

    def admit(self, now: float, u: float) -> bool:
        return False

    def record(self, now: float, *, success: bool) -> None:
        raise AssertionError("askonce: a refused attempt is not made")


REFUSE: AdmissionHandle = _Refuse()


def isawaitable(value: object) -> TypeIs[Awaitable[Any]]:
    """``inspect.isawaitable``, written out: importing ``inspect`` costs almost as much as all of
    ``import askonce`` (``tests/client/test_import_shortcuts.py`` checks they agree)."""
    if isinstance(value, CoroutineType):
        return True
    if isinstance(value, GeneratorType) and value.gi_code.co_flags & _ITERABLE_CORO:
        return True
    return isinstance(value, Awaitable)


_ITERABLE_CORO = 0x100  # inspect.CO_ITERABLE_COROUTINE: a generator made by @types.coroutine


def _now(value: T | Awaitable[T]) -> T:
    if isawaitable(value):
        close = getattr(value, "close", None)
        if close is not None:
            close()  # a coroutine never awaited would warn at garbage collection
        raise TypeError("this store's handles are async: use the async form (an async function, "
                        "`async for`, or an async client)")
    return value


def advance(loop: Generator[Step, Any, Any], value: Any,
            sleep: Callable[[float], object]) -> Attempt | None:
    """The sync driver: run IO and SLEEP steps up to the next attempt (``None``: the loop ended)."""
    try:
        while True:
            kind, what = loop.send(value)
            if kind is ATTEMPT:
                return what  # type: ignore[no-any-return]
            value = sleep(what) if kind is SLEEP else _now(what())
    except StopIteration:
        return None


async def aadvance(loop: Generator[Step, Any, Any], value: Any,
                   sleep: Callable[[float], object]) -> Attempt | None:
    """The async driver: :func:`advance`, awaiting what the steps return."""
    while True:
        try:
            kind, what = loop.send(value)
        except StopIteration:
            return None
        if kind is ATTEMPT:
            return what  # type: ignore[no-any-return]
        value = sleep(what) if kind is SLEEP else what()
        if isawaitable(value):
            value = await value


def _finish(loop: Generator[Step, Any, Ended], tried: Tried) -> None:
    """Let the loop settle a fatal attempt (or an abandoned pass); its re-raise is ours."""
    try:
        advance(loop, tried, no_sleep)
    except BaseException as exc:
        if exc is not tried.error:
            raise


def no_sleep(seconds: float) -> None:  # a fatal attempt ends the loop before any wait
    raise AssertionError("askonce: a fatal attempt cannot lead to a wait")


class Pass:
    """One call's way through the loop as ``with attempt:`` blocks, driven by ``for``/``async for``.

    ``judge(exc)``: the :class:`Tried` of a block that raised ``exc``. In the sync form each block's
    end advances the loop at once (the breaker hears the verdict, the wait is slept, a give-up
    raises from the block). In the async form ``async with attempt:`` does the same, awaited; a
    plain ``with`` leaves it to the next step of the ``async for``.
    """

    __slots__ = ("_judge", "_loop", "_sleep", "path", "tab")

    def __init__(self, loop: Generator[Step, Any, Ended], frame: Frame,
                 judge: Callable[[BaseException], Tried], sleep: Callable[[float], object]) -> None:
        self._loop = loop
        self.tab, self.path = frame
        self._judge = judge
        self._sleep = sleep

    def __iter__(self) -> Iterator[AttemptContext]:
        action = advance(self._loop, None, self._sleep)
        while action is not None:
            ctx = AttemptContext(self, action, True)
            try:
                yield ctx
            except GeneratorExit:
                if ctx.tried is None:
                    _finish(self._loop, abandoned())
                raise
            if ctx.tried is None:
                raise RuntimeError("askonce.retry: each attempt must be used as `with attempt:`")
            action = ctx.next

    async def __aiter__(self) -> AsyncIterator[AttemptContext]:
        action = await aadvance(self._loop, None, self._sleep)
        while action is not None:
            ctx = AttemptContext(self, action, False)
            try:
                yield ctx
            except GeneratorExit:
                tried = ctx.tried if ctx.tried is not None else abandoned()
                if not ctx.advanced and (tried.fatal or tried.failure is None):
                    await self._aclose(tried)
                raise
            if ctx.tried is None:
                raise RuntimeError("askonce.retry: each attempt must be used as `with attempt:`")
            action = (ctx.next if ctx.advanced
                      else await aadvance(self._loop, ctx.tried, self._sleep))

    async def _aclose(self, tried: Tried) -> None:
        try:
            await aadvance(self._loop, tried, self._sleep)
        except BaseException as exc:
            if exc is not tried.error:
                raise


class AttemptContext:
    """One attempt of a :class:`Pass`: ``with attempt:`` runs it with the question bound.

    ``number``: which attempt this is (1 for the first). A shell that makes the attempt itself
    instead of running a block reports its outcome with :meth:`report` (sync) or :meth:`areport`.
    """

    __slots__ = ("_pass", "_sync", "_token", "advanced", "hop", "next", "number", "tried")

    def __init__(self, run: Pass, action: Attempt, sync: bool) -> None:
        self._pass = run
        self._sync = sync
        self.number = action.number
        self.hop: Hop = action.hop
        self.tried: Tried | None = None
        self.next: Attempt | None = None
        self.advanced = False
        self._token: Token[Frame | None] | None = None

    @property
    def frame(self) -> tuple[Tab, tuple[Hop, ...]]:
        """The question as this attempt carries it: the tab and the path with this attempt's hop."""
        return self._pass.tab, (*self._pass.path, self.hop)

    def report(self, tried: Tried) -> None:
        """The attempt came to ``tried``: advance the loop (sync) or keep it for the next step."""
        self.tried = tried
        if not self._sync:
            return
        self.advanced = True
        if tried.fatal:
            _finish(self._pass._loop, tried)
        else:
            self.next = advance(self._pass._loop, tried, self._pass._sleep)

    async def areport(self, tried: Tried) -> None:
        """:meth:`report`, awaiting the loop's steps (the async form)."""
        self.tried, self.advanced = tried, True
        if tried.fatal:
            await self._pass._aclose(tried)
        else:
            self.next = await aadvance(self._pass._loop, tried, self._pass._sleep)

    def __enter__(self) -> AttemptContext:
        self._token = FRAME.set(self.frame)
        return self

    def _exit(self, exc: BaseException | None) -> Tried:
        if self._token is not None:
            FRAME.reset(self._token)
            self._token = None
        return ANSWER if exc is None else self._pass._judge(exc)

    def __exit__(self, t: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        tried = self._exit(exc)
        self.report(tried)
        return exc is not None and not tried.fatal  # a failure the loop retries is swallowed here

    async def __aenter__(self) -> AttemptContext:
        return self.__enter__()

    async def __aexit__(self, t: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool:
        tried = self._exit(exc)
        await self.areport(tried)
        return exc is not None and not tried.fatal


def judge_with(
    matches: Callable[[BaseException], bool], is_failure: Callable[[BaseException], bool] | None
) -> Callable[[BaseException], Tried]:
    """How an in-process attempt that raised is judged: retried if ``on=`` matches, else fatal; the
    verdict for the breaker and the admission controller (when one is set) from ``is_failure``, for
    what ``on=`` names as the dependency's failures and for a give-up from below (an exception that
    carries a reply). Any other exception is the function's own (a ``KeyError``, a validation
    error): no verdict, so the code around a call cannot open a breaker or shed its calls."""

    def judge(exc: BaseException) -> Tried:
        if not matches(exc):
            health = (None if is_failure is None or reply_of(exc) is None or not is_failure(exc)
                      else False)
            return Tried(Failure(retryable=False), health, error=exc, fatal=True)
        health = None if is_failure is None or not is_failure(exc) else False
        return Tried(failure_of(exc), health, error=exc)

    return judge
