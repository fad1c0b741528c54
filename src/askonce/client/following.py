"""The I/O of async mode (``ClientPolicy(respond_async=True)``): a try that follows its 202.

:class:`Following` wraps an HTTP client's exchange (the httpx transports, the requests adapter):
its ``send`` is the try, the request asking ``Prefer: respond-async``, then, for a 202 that
:func:`askonce.client.asyncmode.accepted` follows, the polls of the status location until the
answer, which is returned as the try's response. Every decision is
:mod:`askonce.client.asyncmode`'s; the sync and async twins here only send, sleep and release.
The caller's loop never sees a poll: it judges one try, its answer.

What an exchange offers to be followed (:func:`followable`): the request's ``url``, ``ask_async()``
(add the preference to the request), ``parts(response)`` (status, headers), ``poll(url, prefer,
timeout)`` (a GET of the location with the request's own headers, bar its body's, its question's
and its ``Prefer``) and ``reply_to(response, value)`` (write the try's ``askonce-reply``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from askonce import _stats
from askonce.client.asyncmode import Done, Follow, Lost, Poll, accepted, decide, first_poll
from askonce.client.policy import LOST_OUTCOME, Outcome
from askonce.errors import AnswerLost

R = TypeVar("R")

__all__ = ["AsyncFollowing", "Following", "followable"]


def followable(exchange: object) -> bool:
    """Does this exchange know how to poll (an HTTP client's)? The gRPC client's does not."""
    return callable(getattr(exchange, "poll", None)) and callable(
        getattr(exchange, "ask_async", None))


def _lost(lost: Lost) -> AnswerLost:
    return AnswerLost(f"askonce: the answer of a try taken in async mode was lost ({lost.why})",
                      gone=lost.gone)


class _Base(Generic[R]):
    """What both twins share: the wrapped exchange and what its polls are bounded by."""

    __slots__ = ("cap", "clock", "deadline", "exchange", "sleep")

    def __init__(self, exchange: Any, deadline: float | None, attempt_timeout: float | None,
                 clock: Callable[[], float], sleep: Callable[[float], object]) -> None:
        exchange.ask_async()
        self.exchange = exchange
        self.deadline = deadline
        own = exchange.timeout
        self.cap = (own if attempt_timeout is None else attempt_timeout if own is None
                    else min(own, attempt_timeout))
        self.clock = clock
        self.sleep = sleep

    @property
    def timeout(self) -> float | None:
        return self.exchange.timeout  # type: ignore[no-any-return]

    def judge(self, response: R) -> Outcome:
        return self.exchange.judge(response)  # type: ignore[no-any-return]

    def judge_error(self, error: Exception) -> Outcome | None:
        """A lost answer: gone (404), not an outcome (raised, settled fail closed, never
        retried); otherwise lost as a timed-out try is (toward a callee that joins, re-attached)."""
        if isinstance(error, AnswerLost):
            return None if error.gone else LOST_OUTCOME
        return self.exchange.judge_error(error)  # type: ignore[no-any-return]

    def _accepted(self, response: R) -> Follow | None:
        status, headers = self.exchange.parts(response)
        return accepted(status, headers, self.exchange.url, self.clock(), self.deadline, self.cap)

    def _polled(self, step: Poll, response: R | None, sent: float) -> Poll | Done | Lost:
        now = self.clock()
        if response is None:
            return decide(step.follow, now, None, {}, now - sent)
        status, headers = self.exchange.parts(response)
        return decide(step.follow, now, status, headers, now - sent)

    def _polled_error(self, step: Poll, exc: Exception, sent: float) -> Poll | Done | Lost:
        if self.exchange.judge_error(exc) is None:
            raise exc  # not a transport error: the try's own, passed on
        return self._polled(step, None, sent)

    def _done(self, response: R, done: Done) -> R:
        if done.reply is not None:
            self.exchange.reply_to(response, done.reply)
        _stats.count("client.async.answered")
        return response


class Following(_Base[R]):
    """The sync twin: an exchange whose ``send`` follows a 202 to its answer."""

    __slots__ = ()

    def send(self, header: str, timeout: float | None) -> R:
        exchange = self.exchange
        response: R = exchange.send(header, timeout)
        follow = self._accepted(response)
        if follow is None:
            return response
        step: Poll | Done | Lost = first_poll(follow, self.clock())
        pending: R | None = response  # the latest response not yet released
        while type(step) is Poll:
            if pending is not None:  # the 202 before: released, its connection reused
                exchange.discard(pending)
                pending = None
            if step.after > 0:
                self.sleep(step.after)
            sent = self.clock()
            try:
                pending = exchange.poll(step.follow.url, step.prefer, step.timeout)
            except Exception as exc:
                step = self._polled_error(step, exc, sent)
                continue
            step = self._polled(step, pending, sent)
        if type(step) is Lost:
            if pending is not None:
                exchange.discard(pending)
            raise _lost(step)
        assert pending is not None and type(step) is Done  # decided on a response
        return self._done(pending, step)

    def discard(self, response: R) -> bool | None:
        return self.exchange.discard(response)  # type: ignore[no-any-return]


class AsyncFollowing(_Base[R]):
    """The async twin."""

    __slots__ = ()

    async def send(self, header: str, timeout: float | None) -> R:
        exchange = self.exchange
        response: R = await exchange.send(header, timeout)
        follow = self._accepted(response)
        if follow is None:
            return response
        step: Poll | Done | Lost = first_poll(follow, self.clock())
        pending: R | None = response  # the latest response not yet released
        while type(step) is Poll:
            if pending is not None:  # the 202 before: released, its connection reused
                await exchange.discard(pending)
                pending = None
            if step.after > 0:
                slept = self.sleep(step.after)
                if inspect.isawaitable(slept):
                    await slept
            sent = self.clock()
            try:
                pending = await exchange.poll(step.follow.url, step.prefer, step.timeout)
            except Exception as exc:
                step = self._polled_error(step, exc, sent)
                continue
            step = self._polled(step, pending, sent)
        if type(step) is Lost:
            if pending is not None:
                await exchange.discard(pending)
            raise _lost(step)
        assert pending is not None and type(step) is Done  # decided on a response
        return self._done(pending, step)

    async def discard(self, response: R) -> bool | None:
        return await self.exchange.discard(response)  # type: ignore[no-any-return]

    def fork(self) -> AsyncFollowing[R] | None:
        """A hedge's exchange (``ClientPolicy.hedge``), following its own 202."""
        fork = getattr(self.exchange, "fork", None)
        copy = None if fork is None else fork()
        if copy is None:
            return None
        twin: AsyncFollowing[R] = AsyncFollowing.__new__(AsyncFollowing)
        twin.exchange, twin.deadline, twin.cap = copy, self.deadline, self.cap
        twin.clock, twin.sleep = self.clock, self.sleep
        return twin
