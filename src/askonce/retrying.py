"""``@askonce.retry``: thin sync and async shells over :mod:`askonce.core.retry`.

The shells only bind the question, run attempts, sleep, and translate a give-up into an exception;
every decision is ``RetryState``'s. A layer with no bound question mints one (lazily keyed) so that
inner layers in the same process draw on the same budget instead of each bringing their own.

Two forms, one object::

    @askonce.retry(on=ConnectionError, attempts=3, layer="api")
    def fetch(): ...

    for attempt in askonce.retry(on=ConnectionError, layer="api"):
        with attempt:
            fetch_once()
"""

from __future__ import annotations

import functools
import random as _random
import time
import types
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, cast, overload

from askonce import _stats, propagation
from askonce._context import FRAME
from askonce._loop import REFUSE, AttemptContext, Pass, Tried, judge_with, steps
from askonce.core.admission import AdmissionPolicy
from askonce.core.backoff import Backoff
from askonce.core.bucket import BucketPolicy
from askonce.core.question import Account, Frame, Hop, Tab
from askonce.core.retry import RetryPolicy, RetryState, fits
from askonce.core.wire import valid_name
from askonce.stores import admissions_of, default_store
from askonce.stores.base import AdmissionHandle, BreakerHandle, BucketHandle, Store
from askonce.verdict import is_failure

if TYPE_CHECKING:  # the breaker module is imported only when a breaker is configured
    from askonce.core.breaker import BreakerPolicy

P = ParamSpec("P")
T = TypeVar("T")
# What the fast path's first half found: (tab, path, bucket, full loop?, admission handle).
Prepared = tuple[Tab, tuple["Hop", ...], BucketHandle | None, bool, AdmissionHandle | None]

_UNSET: Any = object()  # an argument not given: RetryPolicy's default, and policy= may be given

OnSpec = type[BaseException] | tuple[type[BaseException], ...] | Callable[[BaseException], bool]
DEFAULT_ON: tuple[type[BaseException], ...] = (ConnectionError, TimeoutError)
# Off by default: the question's budget already bounds what a question costs, and a bucket that
# binds at a half-working target answers fewer questions than plain retries (docs/admission.md).
DEFAULT_BUCKET: BucketPolicy | None = None
DEFAULT_ADMISSION = AdmissionPolicy()

_ON = "on= takes an Exception subclass, a non-empty tuple of them, or a predicate"


def _predicate(on: OnSpec) -> Callable[[BaseException], bool]:
    # KeyboardInterrupt, SystemExit, GeneratorExit and asyncio's CancelledError are not failures
    # of a call: retrying one would swallow a Ctrl-C or a cancellation. A type is refused; a
    # predicate never sees them.
    if isinstance(on, type):
        if not issubclass(on, Exception):
            raise ValueError(f"{_ON} (never retried: BaseExceptions such as KeyboardInterrupt), "
                             f"got {on!r}")
        return lambda exc: isinstance(exc, on)
    if isinstance(on, tuple):
        if not on or not all(isinstance(t, type) and issubclass(t, Exception) for t in on):
            raise ValueError(f"{_ON}, got {on!r}")
        return lambda exc: isinstance(exc, on)
    if callable(on):
        predicate = on
        return lambda exc: isinstance(exc, Exception) and bool(predicate(exc))
    raise ValueError(f"{_ON}, got {on!r}")


def _layer_name(fn: Callable[..., Any]) -> str:
    name = "".join(c if c.isalnum() or c in "_.-" else "."
                   for c in getattr(fn, "__qualname__", "call"))
    name = name.lstrip("0123456789_.-") or "call"
    return name[:32]


# inspect.CO_GENERATOR | CO_ASYNC_GENERATOR, and CO_COROUTINE
_GENERATOR_FLAGS, _COROUTINE_FLAG = 0x20 | 0x200, 0x80


def function_kind(fn: object) -> tuple[bool, bool]:
    """(whether calling ``fn`` makes a generator or an async generator, whether it is a coroutine
    function), as ``inspect`` says. A plain function's code flags say it without ``inspect``, whose
    import (with ``ast``, ``dis`` and ``tokenize``) costs almost as much as all of ``import
    askonce``; anything else (a method, a partial, a
    function marked with ``inspect.markcoroutinefunction``) asks ``inspect``
    (``tests/client/test_import_shortcuts.py`` checks they agree)."""
    if type(fn) is types.FunctionType and not hasattr(fn, "_is_coroutine_marker"):
        flags = fn.__code__.co_flags
        return bool(flags & _GENERATOR_FLAGS), bool(flags & _COROUTINE_FLAG)
    import inspect

    return (inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn),
            inspect.iscoroutinefunction(fn))


class retry:  # spelled like a function: it is used as a decorator
    """A retrying layer: a decorator for sync and ``async`` functions, and an iterable of attempts.

    ``on``: what to retry (exception types or a predicate); the default is connection errors and
    timeouts. ``attempts`` (3), ``backoff``, ``budget`` (2), ``deadline`` (30 s), ``idempotent``
    (True): :class:`RetryPolicy`'s fields and defaults, given here or as one ``policy=`` (not both).
    ``attempts`` is this layer's own limit; ``budget``/``deadline`` apply only when this layer has
    to mint the question (nothing bound); ``originator=True`` mints attributable edge keys.
    ``bucket``: a per-target retry token bucket (off by default; ``BucketPolicy()`` caps retries
    at 20 % of calls plus 10/s); ``breaker``: a circuit
    breaker for the target (off by default; ``CircuitOpen`` when open); ``admission``: adaptive
    admission for the target (on by default; ``core.admission``: once the target answers fewer
    than 5 % of calls, attempts are shed in proportion to the shortfall, ``CircuitOpen`` with
    reason ``shed``; ``None`` turns it off); ``target`` names
    them (default: the layer). ``store``: where they live (default: this process's memory;
    ``askonce.stores.redis``). ``clock``, ``sleep``, ``random``: injectable for tests and
    simulations.
    """

    def __init__(
        self,
        on: OnSpec = DEFAULT_ON,
        *,
        attempts: int = _UNSET,
        layer: str | None = None,
        backoff: Backoff = _UNSET,
        budget: int = _UNSET,
        deadline: float | None = _UNSET,
        idempotent: bool = _UNSET,
        bucket: BucketPolicy | None = DEFAULT_BUCKET,
        breaker: BreakerPolicy | None = None,
        admission: AdmissionPolicy | None = DEFAULT_ADMISSION,
        target: str | None = None,
        originator: bool = False,
        policy: RetryPolicy | None = None,
        store: Store | None = None,
        clock: Callable[[], float] | None = None,
        sleep: Callable[[float], object] | None = None,
        random: Callable[[], float] | None = None,
    ) -> None:
        flat: dict[str, Any] = {
            name: value for name, value in (("attempts", attempts), ("backoff", backoff),
                                            ("budget", budget), ("deadline", deadline),
                                            ("idempotent", idempotent)) if value is not _UNSET}
        if policy is None:
            policy = RetryPolicy(**flat)
        elif not isinstance(policy, RetryPolicy):
            raise ValueError(f"policy must be an askonce.RetryPolicy, got {policy!r}")
        elif flat:
            raise ValueError(f"give either policy= or {', '.join(sorted(flat))}=, not both: "
                             "a policy already holds them")
        self.policy = policy
        if layer is not None and not valid_name(layer):
            raise ValueError(f"layer must be a name like 'api' or 'billing-client', got {layer!r}")
        self.layer = layer
        self.originator = originator
        self._matches = _predicate(on)
        self._bucket_policy = bucket
        self._breaker_policy = breaker
        if admission is not None and not isinstance(admission, AdmissionPolicy):
            raise ValueError(f"admission must be an askonce.core.admission.AdmissionPolicy "
                             f"(or None), got {admission!r}")
        self._admission_policy = admission
        self._guarded: tuple[BreakerHandle | None, AdmissionHandle | None] | None = None
        self._target = target
        self._store = store
        self._clock = clock or _stats.monotonic
        self._sleep = sleep
        self._random = random or _random.random
        self._handle: BucketHandle | None = None

    # --- shared pieces of both shells -------------------------------------------------------------

    def _bucket(self, layer: str) -> BucketHandle | None:
        if self._bucket_policy is None:
            return None
        handle = self._handle
        if handle is None:
            store = self._store or default_store()
            handle = self._handle = store.bucket(self._target or layer, self._bucket_policy)
        return handle

    def _guards(self, layer: str) -> tuple[BreakerHandle | None, AdmissionHandle | None]:
        """The target's breaker and admission handles, made on first use (``None``: not set)."""
        guards = self._guarded
        if guards is None:
            store, target = self._store or default_store(), self._target or layer
            breaker, admission = self._breaker_policy, self._admission_policy
            guards = self._guarded = (
                None if breaker is None else store.breaker(target, breaker),
                None if admission is None else admissions_of(store)(target, admission))
        return guards

    def _frame(self, layer: str) -> tuple[Tab, tuple[Hop, ...]]:
        frame = FRAME.get()
        if frame is not None:
            return frame
        return self._mint(layer), ()

    def _mint(self, layer: str) -> Tab:
        """A question for a layer with nothing bound: its own budget and deadline, keyed lazily."""
        p = self.policy
        deadline = None if p.deadline is None else self._clock() + p.deadline
        return Tab(None, layer, self.originator, Account(p.budget), deadline,
                   minter=propagation.new_key)

    # --- the decorator ----------------------------------------------------------------------------

    @overload
    def __call__(self, fn: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]: ...
    @overload
    def __call__(self, fn: Callable[P, T]) -> Callable[P, T]: ...

    def __call__(self, fn: Callable[P, Any]) -> Callable[P, Any]:
        # @retry above @classmethod: wrap the function inside
        if isinstance(fn, classmethod | staticmethod):
            return cast(Callable[P, Any], type(fn)(self(fn.__func__)))
        if not callable(fn):
            raise ValueError(f"@askonce.retry decorates a function, got {fn!r}")
        generator, coroutine = function_kind(fn)
        if generator:
            # Calling one only makes the generator: its failures come later, while it is iterated,
            # where no retry could resume it. Decorate the function that makes each call instead.
            raise ValueError(f"@askonce.retry cannot retry a generator function ({fn!r}): "
                             "decorate the call inside it")
        layer = self.layer or _layer_name(fn)
        if coroutine:
            return self._async_wrapper(fn, layer)
        return self._sync_wrapper(fn, layer)

    def _judge(self) -> Callable[[BaseException], Tried]:
        """How a raised attempt is judged; with a breaker or admission, the verdict too (both
        learn from it)."""
        guarded = self._breaker_policy is not None or self._admission_policy is not None
        return judge_with(self._matches, is_failure if guarded else None)

    def _pass(self, layer: str, frame: Frame, bucket: BucketHandle | None, first: Tried | None,
              sleep: Callable[[float], object], refused: bool = False) -> Pass:
        """The loop from the first attempt (or after ``first``, made by the fast path, or with
        its refusal by the admission controller)."""
        breaker, admission = self._guards(layer)
        state = RetryState(self.policy, frame[0], layer, bucket is not None)
        loop = steps(state, clock=self._clock, random=self._random, bucket=bucket, breaker=breaker,
                     first=first, admission=REFUSE if refused else admission)
        return Pass(loop, frame, self._judge(), sleep)

    def _start(self, layer: str, sleep: Callable[[float], object]) -> Pass:
        """An iterator-form pass: the frame bound now (or minted), one request for the bucket."""
        frame = self._frame(layer)
        bucket = self._bucket(layer)
        if bucket is not None:
            bucket.deposit()
        return self._pass(layer, frame, bucket, None, sleep)

    def _prepare(self, layer: str) -> Callable[[], Prepared]:
        """The success path's first half, shared by both shells: the frame, the bucket deposit,
        whether the full loop must make the first attempt (a breaker is set, or a bound deadline
        passed), and the admission handle that let the fast path's attempt through (``REFUSE``
        with ``full``: it did not; ``None``: no admission, or the loop asks it)."""
        clock, policy, mint, rand = self._clock, self.policy, self._mint, self._random
        guarded = self._breaker_policy is not None
        admits = self._admission_policy is not None
        guards = self._guards
        get = FRAME.get

        def prepare() -> Prepared:
            frame = get()
            path: tuple[Hop, ...]
            if frame is None:
                tab, path = mint(layer), ()
            else:
                tab, path = frame
            bucket = self._handle if self._handle is not None else self._bucket(layer)
            if bucket is not None:
                bucket.deposit()
            # A question minted just now has its whole deadline ahead; one bound above may not.
            if guarded or (frame is not None and tab.deadline is not None
                           and not fits(policy, tab.deadline, clock())):
                return tab, path, bucket, True, None
            if not admits:
                return tab, path, bucket, False, None
            admission = guards(layer)[1]  # made on first use, then cached
            if not admission.admit(clock(), rand()):  # type: ignore[union-attr]
                return tab, path, bucket, True, REFUSE
            return tab, path, bucket, False, admission

        return prepare

    def _sync_wrapper(self, fn: Callable[P, T], layer: str) -> Callable[P, T]:
        sleep = self._sleep or time.sleep
        judge, prepare, first = self._judge(), self._prepare(layer), (Hop(layer, 1),)
        clock, set_, reset = self._clock, FRAME.set, FRAME.reset

        @functools.wraps(fn)
        def call(*args: P.args, **kwargs: P.kwargs) -> T:
            # The success path, kept flat: one context read, one bind, no state object.
            tab, path, bucket, full, admission = prepare()
            tried = None
            if not full:
                token = set_((tab, path + first))
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:
                    tried = judge(exc)
                    if admission is not None and tried.health is not None:
                        admission.record(clock(), success=tried.health)
                    if tried.fatal:
                        raise
                else:
                    if admission is not None:
                        admission.record(clock(), success=True)
                    return result
                finally:
                    reset(token)
            answer: Any = None
            for attempt in self._pass(layer, (tab, path), bucket, tried, sleep,
                                      admission is REFUSE):
                with attempt:
                    answer = fn(*args, **kwargs)
            return cast(T, answer)

        return call

    def _async_wrapper(self, fn: Callable[P, Awaitable[T]],
                       layer: str) -> Callable[P, Awaitable[T]]:
        import asyncio  # only for a decorated async function: `import askonce` stays asyncio-free

        sleep = self._sleep or asyncio.sleep
        judge, prepare, first = self._judge(), self._prepare(layer), (Hop(layer, 1),)
        clock, set_, reset = self._clock, FRAME.set, FRAME.reset

        @functools.wraps(fn)
        async def call(*args: P.args, **kwargs: P.kwargs) -> T:
            tab, path, bucket, full, admission = prepare()
            tried = None
            if not full:
                token = set_((tab, path + first))
                try:
                    result = await fn(*args, **kwargs)
                except BaseException as exc:
                    tried = judge(exc)
                    if admission is not None and tried.health is not None:
                        admission.record(clock(), success=tried.health)
                    if tried.fatal:
                        raise
                else:
                    if admission is not None:
                        admission.record(clock(), success=True)
                    return result
                finally:
                    reset(token)
            answer: Any = None
            async for attempt in self._pass(layer, (tab, path), bucket, tried, sleep,
                                            admission is REFUSE):
                async with attempt:
                    answer = await fn(*args, **kwargs)
            return cast(T, answer)

        return call

    # --- the iterator form ------------------------------------------------------------------------

    def __iter__(self) -> Iterator[AttemptContext]:
        return iter(self._start(self.layer or "block", self._sleep or time.sleep))

    def __aiter__(self) -> AsyncIterator[AttemptContext]:
        import asyncio

        return self._start(self.layer or "block", self._sleep or asyncio.sleep).__aiter__()
