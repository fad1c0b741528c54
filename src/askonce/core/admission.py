"""Adaptive admission: shed a layer's attempts in proportion to how badly the target is failing.

A sans-IO state machine in the shape of Google SRE's client-side throttling and Envoy's admission
control filter. Over a sliding window of whole seconds it counts the attempts it was asked about
(``requests``), the attempts that were made and judged (``calls``) and those that succeeded
(``successes``). Each new attempt is refused with probability::

    p = min(max_reject, max(0, (calls - successes / min_success) / (calls + 1)))

and never while the window holds fewer than ``min_requests`` requests. With ``calls`` in the
formula (Envoy's choice) ``p`` is about ``1 - s / min_success`` at a success rate ``s``: nothing is
shed while ``s >= min_success``, and below it the shedding grows in proportion to the shortfall.

Why ``min_success`` is small by default (0.05): when failures do not depend on load (a flaky
dependency), refusing a first attempt only loses the answer it had a chance ``s`` of bringing, and
no retries at all would have sent it; relief for the target is worth that only when it answers
almost nothing. ``max_reject`` keeps a trickle of attempts going so that recovery is seen at
once: with ``p`` capped at 0.99 a retry of a failed attempt gets through about 1 time in 100, so a
dead target sees about 1.01-1.02 arrivals per question (E1: 1.013-1.020; docs/admission.md).

With ``count_rejected=True`` the formula uses ``requests`` instead of ``calls``, as the SRE book's
``(requests - K * accepts) / (requests + 1)`` does (``K = 1 / min_success``). That variant
collapses to a trickle at any success rate below ``1 / K`` (admitting a share ``a`` of the
requests, it earns ``K * s * a`` of them: the share shrinks whenever ``K * s < 1``); it is kept for
comparison (docs and the simulator), not as the default.

Time is an input (monotonic seconds), never read here; a ``now`` earlier than one already seen is
taken as the latest seen, and a non-finite ``now`` raises ``ValueError``. The random draw ``u`` in
``[0, 1)`` is an input too. The object holds no lock; the shells serialise access to it.
"""

from __future__ import annotations

import math
from typing import Final

from askonce.core import is_int, is_real
from askonce.core.record import Record

__all__ = ["Admission", "AdmissionPolicy"]

_MAX_WINDOW: Final = 3600  # seconds: one bucket each


class AdmissionPolicy(Record):
    """When a layer starts shedding its attempts to a failing target, and how many at most."""

    __slots__ = __match_args__ = ("window", "min_success", "max_reject", "min_requests",
                                  "count_rejected")
    window: int  # whole seconds of history
    min_success: float  # nothing is shed while the success rate is at least this
    max_reject: float  # never shed more than this share: the trickle that sees recovery
    min_requests: int  # no shedding before the window holds this many requests
    count_rejected: bool  # True: the SRE book's formula (requests, not calls)

    def __init__(self, window: int = 10, min_success: float = 0.05, max_reject: float = 0.99,
                 min_requests: int = 20, count_rejected: bool = False) -> None:
        _set = object.__setattr__
        _set(self, "window", window)
        _set(self, "min_success", min_success)
        _set(self, "max_reject", max_reject)
        _set(self, "min_requests", min_requests)
        _set(self, "count_rejected", count_rejected)
        self.__post_init__()

    def __post_init__(self) -> None:
        if not is_int(self.window) or not 1 <= self.window <= _MAX_WINDOW:
            raise ValueError(f"admission window must be an int within 1..{_MAX_WINDOW} s, "
                             f"got {self.window!r}")
        if not is_real(self.min_success) or not 0 < self.min_success <= 1:
            raise ValueError(f"admission min_success must be within (0, 1], "
                             f"got {self.min_success!r}")
        if not is_real(self.max_reject) or not 0 <= self.max_reject < 1:
            raise ValueError(f"admission max_reject must be within [0, 1), "
                             f"got {self.max_reject!r}")
        if not is_int(self.min_requests) or not 1 <= self.min_requests <= 1_000_000_000:
            raise ValueError(f"admission min_requests must be an int >= 1, "
                             f"got {self.min_requests!r}")
        if not isinstance(self.count_rejected, bool):
            raise ValueError(f"admission count_rejected must be True or False, "
                             f"got {self.count_rejected!r}")


class Admission:
    """One layer's admission state for one target. Not thread-safe: the shells lock around it."""

    __slots__ = ("_calls", "_edge", "_head", "_i", "_now", "_policy", "_requests", "_successes",
                 "calls", "requests", "successes")  # fmt: skip

    def __init__(self, policy: AdmissionPolicy = AdmissionPolicy()) -> None:
        self._policy = policy
        n = policy.window
        self._requests = [0] * n  # per bucket
        self._calls = [0] * n
        self._successes = [0] * n
        self._head: int | None = None  # the latest second rolled to
        self._now: float | None = None
        self._edge = -math.inf  # where the latest second ends: before it, no roll is needed
        self._i = 0  # the latest second's bucket
        self.requests = self.calls = self.successes = 0  # running totals over the window

    @property
    def policy(self) -> AdmissionPolicy:
        return self._policy

    def reject_probability(self, now: float) -> float:
        """The chance that an attempt asked about at ``now`` is refused."""
        self._tick(now)
        return self._p()

    def admit(self, now: float, u: float) -> bool:
        """Count an attempt and decide it: refused when the draw ``u`` in [0, 1) is below ``p``."""
        if not 0 <= u < 1:  # written so that NaN fails too
            raise ValueError(f"admission draw must be within [0, 1), got {u!r}")
        last = self._now
        if last is not None and last <= now < self._edge:  # _tick's same-second case, inline
            self._now = now
            i = self._i
        else:
            i = self._tick(now)
        # Judged on the window before this request; p = 0 needs no arithmetic (the common case).
        policy = self._policy
        ok = (self.requests < policy.min_requests
              or (not policy.count_rejected
                  and self.calls * policy.min_success <= self.successes)
              or not u < self._p())
        self._requests[i] += 1
        self.requests += 1
        return ok

    def record(self, now: float, *, success: bool) -> None:
        """The verdict on an attempt that was admitted and made."""
        last = self._now
        if last is not None and last <= now < self._edge:
            self._now = now
            i = self._i
        else:
            i = self._tick(now)
        self._calls[i] += 1
        self.calls += 1
        if success:
            self._successes[i] += 1
            self.successes += 1

    def add(self, now: float, requests: int, calls: int, successes: int) -> None:
        """Count a batch in ``now``'s second: a local controller seeded with the fleet's window
        when the shared one cannot be reached. Counts that do not read (negative, or successes
        above calls) are clamped."""
        for name, n in (("requests", requests), ("calls", calls), ("successes", successes)):
            if not is_int(n):
                raise ValueError(f"admission {name} must be an int, got {n!r}")
        calls = max(0, calls)
        successes = max(0, min(calls, successes))
        requests = max(0, requests)
        i = self._tick(now)
        self._requests[i] += requests
        self._calls[i] += calls
        self._successes[i] += successes
        self.requests += requests
        self.calls += calls
        self.successes += successes

    def at_rest(self, now: float) -> bool:
        """No failure in its window: forgetting it loses no history that could shed. A store evicts
        such controllers before ones that have seen failures."""
        self._tick(now)
        return self.calls == self.successes

    def snapshot(self) -> dict[str, object]:
        """Counters as of the latest ``now`` seen."""
        return {"requests": self.requests, "calls": self.calls, "successes": self.successes,
                "reject_probability": self._p(), "now": self._now}

    def _p(self) -> float:
        policy = self._policy
        if self.requests < policy.min_requests:
            return 0.0
        n = self.requests if policy.count_rejected else self.calls
        p = (n - self.successes / policy.min_success) / (n + 1)
        return 0.0 if p <= 0 else min(p, policy.max_reject)

    def _tick(self, now: float) -> int:
        """Roll the window to ``now``'s second (buckets of seconds that left it are emptied); the
        index of its bucket. Times never go back (see the module), so ``sec >= head``."""
        if not math.isfinite(now):
            raise ValueError(f"admission time must be finite seconds, got {now!r}")
        if self._now is not None and now < self._now:
            now = self._now
        self._now = now
        sec = math.floor(now)
        size = self._policy.window
        head = self._head
        if head is None or sec - head >= size:
            for buckets in (self._requests, self._calls, self._successes):
                buckets[:] = [0] * size
            self.requests = self.calls = self.successes = 0
        elif sec > head:
            for s in range(head + 1, sec + 1):
                i = s % size
                self.requests -= self._requests[i]
                self.calls -= self._calls[i]
                self.successes -= self._successes[i]
                self._requests[i] = self._calls[i] = self._successes[i] = 0
        if head is None or sec > head:
            self._head = sec
            self._edge = sec + 1
            self._i = sec % size
        return self._i
