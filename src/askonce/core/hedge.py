"""Hedging: a second try of a slow call, paid for out of the question's budget.

A call that may hedge (an idempotent one, or one to a callee that joins repeated questions) sends
its first try and, if that has not answered after a delay, one hedge: the same question (key,
deadline) on the path hop ``layer:2``, forwarding no budget. The first answer wins and the other try
is cancelled. A hedge is an arrival like a retry, so it costs one from the question's account: the
shell reserves that one (``Account.hold(1)``) before holding the rest for the first try, the reserve
is the hedge's cost when it fires and goes back when it does not. First try plus hedge therefore
stay within ``1 + budget`` arrivals, whatever the first try's callee does with what it was sent.

Two objects, both pure (times are inputs, nothing sleeps):

* :class:`Hedger`, one per target: learns the latency of the target's answers (a bounded ring,
  its percentile recomputed every ``every`` samples), says how long a call waits before hedging,
  and throttles hedges with a token budget (each call earns ``max_share`` of a token, a hedge takes
  a whole one: Finagle's ``BackupRequestFilter``, gRPC's hedging throttle). A reply that pushes back
  stops hedging to that target for the pushback's time: a hedge would add to the load it sheds.
* :class:`Race`, one per hedged call: which try's outcome the call goes on with (the first answer or
  non-retryable failure wins; a retryable failure waits for the other try) and what is still held
  for it, the other try settled (a cancelled one fail closed, as a lost call).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from askonce.core import is_int, is_real
from askonce.core.question import Account
from askonce.core.retry import LOCAL, Failure, settle
from askonce.core.wire import Reply

FIRST, HEDGE = 0, 1


@dataclass(frozen=True, slots=True)
class HedgePolicy:
    """When a call sends a hedge, and how many it may send.

    ``delay``: a fixed wait in seconds before the hedge; ``None`` (the default): the target's
    ``percentile`` latency, learned from its last ``window`` answers (recomputed every ``every``),
    and no hedge before ``min_samples`` of them. ``min_delay``: the shortest wait ever used.
    ``max_share``: the hedges' share of calls at most (each call earns that much of a token, a
    hedge spends one, at most ``burst`` are banked; a new target's hedger starts with one).
    ``pause``: seconds without hedges to a target after it answered do-not-retry for overload
    without a pushback of its own. One hedge per call at most (gRPC's ``maxAttempts`` 2).
    """

    delay: float | None = None
    percentile: float = 0.97
    min_delay: float = 0.001
    window: int = 1000
    every: int = 50
    min_samples: int = 100
    max_share: float = 0.05
    burst: float = 10.0
    pause: float = 1.0

    def __post_init__(self) -> None:
        d = self.delay
        if d is not None and not (is_real(d) and 0 < d <= 3600):
            raise ValueError(f"hedge delay must be within (0, 3600] s or None, got {d!r}")
        for name, low, high in (("percentile", 0.5, 0.999), ("min_delay", 0.0, 3600.0),
                                ("max_share", 0.0, 0.5), ("burst", 1.0, 1e6),
                                ("pause", 0.0, 3600.0)):
            value = getattr(self, name)
            if not (is_real(value) and low <= value <= high):
                raise ValueError(f"hedge {name} must be within {low:g}..{high:g}, got {value!r}")
        for name, high in (("window", 100_000), ("every", 100_000), ("min_samples", 100_000)):
            value = getattr(self, name)
            if not (is_int(value) and 1 <= value <= high):
                raise ValueError(f"hedge {name} must be an integer within 1..{high}, "
                                 f"got {value!r}")
        if self.min_samples > self.window:
            raise ValueError(f"hedge min_samples ({self.min_samples}) must not exceed window "
                             f"({self.window}): the ring never holds more")


class Hedger:
    """One target's hedging state: recent latencies, the learned delay, the token budget."""

    __slots__ = ("_next", "_ring", "_since", "learned", "paused_until", "policy", "seen",
                 "tokens")

    def __init__(self, policy: HedgePolicy) -> None:
        self.policy = policy
        self._ring: list[float] = []
        self._next = 0  # where the next sample overwrites, once the ring is full
        self._since = 0  # samples since the percentile was last computed
        self.seen = 0  # samples ever observed
        self.learned: float | None = None  # the latest percentile, once min_samples were seen
        self.tokens = 1.0  # a fresh hedger may hedge once; then calls earn what it spends
        self.paused_until = -math.inf

    def observe(self, latency: float) -> None:
        """An answer of the target came ``latency`` seconds after its call was sent."""
        if not latency >= 0 or latency == math.inf:  # NaN or a clock gone wrong: not a sample
            return
        p, ring = self.policy, self._ring
        if len(ring) < p.window:
            ring.append(latency)
        else:
            ring[self._next] = latency
            self._next = (self._next + 1) % p.window
        self.seen += 1
        self._since += 1
        if len(ring) >= p.min_samples and (self.learned is None or self._since >= p.every):
            self._since = 0
            ordered = sorted(ring)
            rank = max(1, math.ceil(p.percentile * len(ordered)))  # nearest rank
            self.learned = ordered[rank - 1]

    def plan(self, now: float) -> float | None:
        """A call starts: it earns its share of a token; the seconds it waits before a hedge, or
        ``None`` if it will not hedge (no delay learned yet, paused, or no whole token to spend)."""
        p = self.policy
        self.tokens = min(p.burst, self.tokens + p.max_share)
        if now < self.paused_until or self.tokens < 1:
            return None
        delay = p.delay if p.delay is not None else self.learned
        return None if delay is None else max(delay, p.min_delay)

    def take(self, now: float) -> bool:
        """A hedge is about to be sent: spend its token (``False``: none left, or paused since the
        call started)."""
        if now < self.paused_until or self.tokens < 1:
            return False
        self.tokens -= 1
        return True

    def heard(self, now: float, reply: Reply | None) -> None:
        """A reply of the target: a pushback, or a do-not-retry for overload, stops hedging to it
        for that long (``pause`` when the reply says no time)."""
        if reply is None or (reply.pushback is None and not (
                reply.dnr and reply.reason in ("overloaded", "shed", "throttled"))):
            return
        wait = reply.pushback if reply.pushback is not None else self.policy.pause
        if wait == wait:  # NaN: an in-process reply's wait nobody can tell
            self.paused_until = max(self.paused_until, now + min(wait, 3600.0))


def wins(failure: Failure | None) -> bool:
    """Does this outcome of one try end the race? An answer, or a failure no retry would change."""
    return failure is None or not failure.retryable


def _stop(failure: Failure) -> tuple[bool, float]:
    reply = failure.reply
    dnr = reply is not None and reply.dnr
    wait = max(0.0 if reply is None or reply.pushback is None else reply.pushback,
               failure.retry_after or 0.0)
    return dnr, wait if wait == wait else math.inf


class Race:
    """A hedged call's first try and its hedge: which outcome the call goes on with.

    ``held``: what the first try forwarded; ``reserved``: what was held for the hedge (0 or 1).
    Feed each try's outcome to :meth:`heard`; once it names a try, :meth:`settle` settles
    everything but that try and returns what is still held for it, which the shell settles with
    that try's outcome (``core.retry.settle``, or hands to the retry loop as its ``held``).
    """

    __slots__ = ("account", "done", "failures", "fired", "held", "reserved")

    def __init__(self, account: Account, held: int, reserved: int) -> None:
        self.account = account
        self.held = held
        self.reserved = reserved
        self.fired = False
        self.done = [False, False]
        self.failures: list[Failure | None] = [None, None]

    def fire(self) -> bool:
        """The hedge is sent: the reserve is its cost (``False``: nothing was reserved)."""
        if self.reserved < 1 or self.fired:
            return False
        self.fired = True
        return True

    def heard(self, which: int, failure: Failure | None) -> int | None:
        """Try ``which`` (``FIRST`` or ``HEDGE``) came to ``failure`` (``None``: answered): the try
        the call goes on with, or ``None`` to wait for the other. When both failed, the one that
        says stop (a do-not-retry, then the longer pushback) is passed on, else the first."""
        self.done[which], self.failures[which] = True, failure
        if wins(failure):
            return which
        other = 1 - which
        if self.fired and not self.done[other]:
            return None
        if not self.fired:
            return FIRST
        first, hedge = self.failures
        assert first is not None and hedge is not None  # both failed: neither wins
        return HEDGE if _stop(hedge) > _stop(first) else FIRST

    def settle(self, which: int) -> int:
        """The call goes on with try ``which``: give back an unused reserve, settle the first try
        if it is not the one (by its outcome, or as lost when it was cancelled unanswered), and
        return what is still held for ``which``."""
        if not self.fired and self.reserved:
            self.account.release(self.reserved)
        self.reserved = 0
        if which == FIRST:
            return self.held
        held, self.held = self.held, 0
        failure = self.failures[FIRST]
        if failure is not None and failure.delivery != LOCAL:  # it failed first: its outcome
            settle(self.account, held, failure.delivery, failure.reply)
        # else it was cancelled while it ran: it may have spent all it was forwarded (fail closed)
        return 0
