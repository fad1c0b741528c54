"""Adaptive concurrency at the target: a limit on requests in flight that follows measured latency.

A server that takes every request queues what it cannot serve; once the queue is longer than its
callers wait, it works only for callers who have gone (a metastable failure). :class:`Limiter`
keeps the queue short instead: what is over the limit is refused at once (the server middleware
answers 503 with ``askonce-reply: dnr, r=overloaded`` and a pushback), so callers learn of the
overload in a millisecond and the reply channel carries it up as backpressure.

The limit is a gradient controller in the manner of Envoy's adaptive concurrency filter and
Netflix's Gradient2. Latencies are gathered in windows (at least ``interval`` seconds and
``min_samples`` requests); at each window's end

* the window's sample is its *shortest* latency: queueing delays every request, the fastest too,
  while a slow tail (a few expensive requests) leaves it alone and so is not taken for overload;
* the baseline follows the samples: down at once, up with the time constant ``baseline_window``
  (so a service that has really become slower is eventually taken as it is, while a queue that
  builds within seconds is not);
* ``gradient = clamp(tolerance * baseline / sample, 0.5, 1)`` and the new limit is
  ``limit * gradient + headroom``: taken at once when it is lower (a queue must stop growing now),
  by ``smoothing`` of the step when it is higher, and only when the window used at least half the
  limit (an idle server learns nothing about its capacity).

Where the baseline lags a service that has slowed, the limit settles near
``headroom / (1 - gradient)`` (at most ``2 * headroom``) until it catches up. Memory is a fixed
handful of numbers. No clock is read here: ``now`` (monotonic seconds) and the latencies are inputs.
The limiter is not thread-safe; a shell that serves from several threads holds a lock around it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from askonce.core import is_int, is_real

MIN_GRADIENT = 0.5  # the most one window can cut the limit by (before the headroom is added)
STALE = 4  # windows' worth of time after which the latest fastest latency is no longer believed
TAKEN, TOO_LATE, OVER = 0, 1, 2  # what :meth:`Limiter.enter` decided


@dataclass(frozen=True, slots=True)
class ConcurrencyPolicy:
    """How a :class:`Limiter` adapts (module docstring).

    ``initial_limit``/``min_limit``/``max_limit``: requests in flight, whole numbers.
    ``interval`` (seconds) and ``min_samples``: a window lasts at least both. ``tolerance``: how far
    above the baseline latency may rise before the limit shrinks. ``headroom``: requests added to
    ``limit * gradient`` at each window (the queue allowed). ``smoothing``: the share of a rise
    taken per window. ``baseline_window``: seconds, the time constant of the baseline's rise.
    ``pushback``: seconds a refused caller is asked to wait (``Retry-After``, the reply's ``p``).
    """

    initial_limit: int = 20
    min_limit: int = 4
    max_limit: int = 1000
    interval: float = 0.1
    min_samples: int = 5
    tolerance: float = 1.5
    headroom: float = 4.0
    smoothing: float = 0.5
    baseline_window: float = 10.0
    pushback: float = 1.0

    def __post_init__(self) -> None:
        for name in ("initial_limit", "min_limit", "max_limit", "min_samples"):
            value = getattr(self, name)
            if not is_int(value) or not 1 <= value <= 1_000_000:
                raise ValueError(f"{name} must be an integer within 1..1000000, got {value!r}")
        if not self.min_limit <= self.initial_limit <= self.max_limit:
            raise ValueError("limits must satisfy min_limit <= initial_limit <= max_limit, got "
                             f"{self.min_limit!r}, {self.initial_limit!r}, {self.max_limit!r}")
        checks = (("interval", 0.0, 60.0, False), ("baseline_window", 0.0, 86_400.0, False),
                  ("headroom", 0.0, 1_000_000.0, True), ("smoothing", 0.0, 1.0, False),
                  ("pushback", 0.0, 86_400.0, True))
        for name, low, high, closed in checks:
            value = getattr(self, name)
            if not is_real(value) or not (low <= value if closed else low < value) or value > high:
                raise ValueError(f"{name} must be a number within {'[' if closed else '('}"
                                 f"{low:g}, {high:g}], got {value!r}")
        if not is_real(self.tolerance) or not 1 <= self.tolerance <= 100:
            raise ValueError(f"tolerance must be a number within [1, 100], got {self.tolerance!r}")


class Limiter:
    """Requests in flight against an adaptive limit; see the module docstring.

    ``try_acquire(now)`` before the work (``False``: refuse it), ``release(now, latency, ok)`` after
    it, once per acquired slot. ``ok=False``: the request failed or was cut short; its latency is a
    sample only if it is longer than the baseline (a slow failure tells of queueing like a slow
    success; a quick one tells nothing about capacity).
    """

    __slots__ = ("_count", "_fastest", "_last", "_limit", "_peak", "_start", "baseline",
                 "inflight", "policy", "recent")

    def __init__(self, policy: ConcurrencyPolicy = ConcurrencyPolicy()) -> None:
        self.policy = policy
        self._limit = float(policy.initial_limit)
        self.inflight = 0
        self.baseline: float | None = None  # seconds; None until the first window ends
        self.recent: float | None = None  # the latest window's fastest latency, seconds
        self._last: float | None = None  # when the baseline last moved
        self._start: float | None = None  # the open window: when its first sample came
        self._count = 0
        self._fastest = math.inf
        self._peak = 0  # the most in flight during the window

    @property
    def limit(self) -> int:
        """The requests allowed in flight now."""
        return int(self._limit)

    def try_acquire(self, now: float) -> bool:
        """Take a slot if one is free under the limit."""
        if self.inflight >= int(self._limit):
            return False
        self.inflight += 1
        if self.inflight > self._peak:
            self._peak = self.inflight
        return True

    def too_late(self, now: float, deadline: float) -> bool:
        """Whether a request whose caller stops waiting at ``deadline`` cannot be answered by then
        even as fast as the latest window's fastest request was: working on it would only take a
        slot from one that can. A figure no window has renewed for ``STALE`` times its own length
        (or the interval) says nothing any more: nothing is too late then, so requests run again
        and measure afresh (refusing every request on an old figure would never end)."""
        recent, last = self.recent, self._last
        if recent is None or last is None or now - last > STALE * max(self.policy.interval, recent):
            return False
        return deadline - now < recent

    def enter(self, now: float, deadline: float | None) -> int:
        """Decide a request at the door, as every shell does: ``TOO_LATE`` (its caller stops
        waiting at ``deadline`` before it could be answered: :meth:`too_late`), ``OVER`` (no slot
        under the limit), or ``TAKEN`` (it holds a slot: :meth:`release` it after)."""
        if deadline is not None and self.too_late(now, deadline):
            return TOO_LATE
        return TAKEN if self.try_acquire(now) else OVER

    def release(self, now: float, latency: float, ok: bool = True) -> None:
        """Give back a slot taken by :meth:`try_acquire`; ``latency``: seconds the request took."""
        if self.inflight > 0:
            self.inflight -= 1
        # A clock that stepped, or NaN: no sample (a float, the common case, skips is_real).
        if (not ((type(latency) is float or is_real(latency)) and 0 <= latency < math.inf)
                or not (type(now) is float or is_real(now))):
            return
        if not ok and (self.baseline is None or latency <= self.baseline):
            return
        if self._start is None:
            self._start = now
            self._peak = max(self._peak, self.inflight + 1)
        self._count += 1
        if latency < self._fastest:
            self._fastest = latency
        p = self.policy
        if self._count >= p.min_samples and now - self._start >= p.interval:
            self._update(now)

    def _update(self, now: float) -> None:
        p, sample, base = self.policy, self._fastest, self.baseline
        if base is None or sample <= base:
            base = sample
        else:
            elapsed = max(0.0, now - (self._last if self._last is not None else now))
            base += (sample - base) * (elapsed / (elapsed + p.baseline_window))
        self.baseline, self._last, self.recent = base, now, sample
        gradient = 1.0 if sample <= 0 else max(MIN_GRADIENT, min(1.0, p.tolerance * base / sample))
        limit = self._limit
        target = limit * gradient + p.headroom
        if target < limit:
            limit = target
        elif self._peak * 2 >= limit:
            limit += (target - limit) * p.smoothing
        self._limit = min(float(p.max_limit), max(float(p.min_limit), limit))
        self._start, self._count, self._fastest, self._peak = None, 0, math.inf, self.inflight
