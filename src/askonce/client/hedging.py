"""The client's side of hedging (``ClientPolicy.hedge``): hedgers by target, and the async race.

:class:`Hedgers` keeps one :class:`~askonce.core.hedge.Hedger` per target, at most ``limit`` of them
(past it the oldest is forgotten, and a forgotten target learns its latency again), behind one lock:
a Caller may serve several threads and event loops. :func:`race` runs a hedged call's first try and,
if it has not answered after the delay, the hedge the shell builds, as two asyncio tasks; the
:class:`~askonce.core.hedge.Race` says which outcome the call goes on with, and the other try is
cancelled (or, if it had already come back, its response is discarded). Every decision is the
core's; this module only schedules, cancels and cleans up.

Only the async client hedges: a sync call would need a thread per hedge to wait on two sockets at
once, and a thread per slow call is the resource a tail already uses up.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

from askonce.core.hedge import FIRST, HEDGE, HedgePolicy, Hedger, Race
from askonce.core.wire import Reply

if TYPE_CHECKING:
    import asyncio

    from askonce._loop import Tried

__all__ = ["Hedgers", "forget", "hedgers_for", "race"]


class Hedgers:
    """Hedgers by target, at most ``limit``; one per hedge policy in a process
    (:func:`hedgers_for`), shared by every :class:`~askonce.client.Caller` with that policy."""

    __slots__ = ("_by_target", "_lock", "limit", "policy")

    def __init__(self, policy: HedgePolicy, limit: int = 1024) -> None:
        self.policy = policy
        self.limit = limit
        self._by_target: dict[str, Hedger] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._by_target)

    def _get(self, target: str) -> Hedger:  # under the lock
        hedger = self._by_target.get(target)
        if hedger is None:
            if len(self._by_target) >= self.limit:
                self._by_target.pop(next(iter(self._by_target)))
            hedger = self._by_target[target] = Hedger(self.policy)
        return hedger

    def plan(self, target: str, now: float) -> float | None:
        with self._lock:
            return self._get(target).plan(now)

    def take(self, target: str, now: float) -> bool:
        with self._lock:
            return self._get(target).take(now)

    def observe(self, target: str, latency: float) -> None:
        with self._lock:
            self._get(target).observe(latency)

    def heard(self, target: str, now: float, reply: Reply | None) -> None:
        if reply is not None and (reply.pushback is not None or reply.dnr):
            with self._lock:
                self._get(target).heard(now, reply)


# The process's hedgers, one per policy: every client (transport, pool) with the same policy learns
# a target's latency together and shares its hedge tokens. Bounded: past it a policy gets hedgers
# of its own.
_SHARED: dict[HedgePolicy, Hedgers] = {}
_SHARED_LOCK = threading.Lock()
MAX_POLICIES = 64


def forget() -> None:
    """Forget every policy's hedgers (what they learned, their tokens, their pauses): for tests,
    and for a process that changes what its targets are."""
    with _SHARED_LOCK:
        _SHARED.clear()


def hedgers_for(policy: HedgePolicy) -> Hedgers:
    """The hedgers of ``policy`` in this process (:class:`Hedgers`)."""
    with _SHARED_LOCK:
        hedgers = _SHARED.get(policy)
        if hedgers is None:
            hedgers = Hedgers(policy)
            if len(_SHARED) < MAX_POLICIES:
                _SHARED[policy] = hedgers
        return hedgers


Judge = Callable[[int, Any, "BaseException | None"], "Tried"]


async def race(state: Race, first: Coroutine[Any, Any, Any], delay: float | None,
               hedge: Callable[[], Coroutine[Any, Any, Any] | None], judge: Judge,
               discard: Callable[[Any], Awaitable[object]]) -> tuple[int, Tried]:
    """Run the first try; after ``delay`` seconds without its outcome, the hedge (``hedge()``:
    its coroutine, or ``None`` when it may not be sent). Returns the try the call goes on with
    and its :class:`Tried`; every other try is cancelled or its response discarded first.
    ``judge(which, response, error)``: a try's outcome (a task that raised has ``response``
    ``None``). A fatal outcome ends the race at once. Without a ``delay`` (no hedge this time) the
    first try is only awaited, in the caller's own task."""
    if delay is None:
        try:
            response = await first
        except BaseException as exc:
            return FIRST, judge(FIRST, None, exc)
        return FIRST, judge(FIRST, response, None)
    import asyncio

    tasks: dict[asyncio.Future[Any], int] = {asyncio.ensure_future(first): FIRST}
    tried: dict[int, Tried] = {}
    try:
        done, _ = await asyncio.wait(tasks, timeout=delay)
        if not done:
            coro = hedge()
            if coro is not None:
                tasks[asyncio.ensure_future(coro)] = HEDGE
        while True:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=tasks.__getitem__):  # the first try's outcome first
                which = tasks.pop(task)
                error = task.exception()
                one = tried[which] = judge(which, None if error else task.result(), error)
                pick = which if one.fatal else state.heard(which, one.failure)
                if pick is not None:
                    for other, theirs in tried.items():
                        if other != pick and theirs.response is not None:
                            await discard(theirs.response)
                    return pick, tried[pick]
    finally:
        await _cancel(tasks, discard)


async def _cancel(tasks: dict[asyncio.Future[Any], int],
                  discard: Callable[[Any], Awaitable[object]]) -> None:
    """Cancel the tries still running and wait for them; a response one of them got in the
    meantime (or had got in the same instant as the winner) is discarded."""
    import asyncio

    for task in tasks:
        task.cancel()
    for response in await asyncio.gather(*tasks, return_exceptions=True):
        if not isinstance(response, BaseException):  # cancelled or failed: nothing to release
            await discard(response)
