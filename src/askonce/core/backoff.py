"""Capped exponential backoff with full jitter.

Full jitter (a uniform draw between zero and the capped exponential) spreads retries of many clients
that failed together; AWS's study found it needs the fewest calls to finish contended work. The
random draw is an input, so the same policy runs on a virtual clock with seeded randomness in the
simulator.
"""

from __future__ import annotations

from askonce.core import is_real
from askonce.core.record import Record


class Backoff(Record):
    """``delay(n, u) = u * min(cap, base * multiplier ** (n - 1))`` for the n-th retry,
    ``u`` in [0, 1)."""

    __slots__ = __match_args__ = ("base", "cap", "multiplier", "jitter")
    base: float
    cap: float
    multiplier: float
    jitter: bool

    def __init__(self, base: float = 0.05, cap: float = 2.0, multiplier: float = 2.0,
                 jitter: bool = True) -> None:
        _set = object.__setattr__
        _set(self, "base", base)
        _set(self, "cap", cap)
        _set(self, "multiplier", multiplier)
        _set(self, "jitter", jitter)
        self.__post_init__()

    def __post_init__(self) -> None:
        for name in ("base", "cap", "multiplier"):
            value = getattr(self, name)
            if not is_real(value):
                raise ValueError(f"backoff {name} must be a number of seconds, got {value!r}")
        if not isinstance(self.jitter, bool):  # "no" is truthy: jitter would be on
            raise ValueError(f"backoff jitter must be True or False, got {self.jitter!r}")
        if not 0 <= self.base <= 3600:
            raise ValueError(f"backoff base must be within 0..3600 s, got {self.base!r}")
        if not self.base <= self.cap <= 3600:
            raise ValueError(f"backoff cap must be within base..3600 s, got {self.cap!r}")
        if not 1 <= self.multiplier <= 100:
            raise ValueError(f"backoff multiplier must be within 1..100, got {self.multiplier!r}")

    def ceiling(self, retry: int) -> float:
        """The largest delay before retry number ``retry`` (1 for the first retry)."""
        if retry <= 1:
            return min(self.cap, self.base)
        # Past ~64 doublings the product overflows nothing but is far above any cap; stop early.
        exp = min(retry - 1, 64)
        return min(self.cap, self.base * self.multiplier**exp)

    def delay(self, retry: int, u: float) -> float:
        ceiling = self.ceiling(retry)
        return u * ceiling if self.jitter else ceiling


NO_WAIT = Backoff(base=0.0, cap=0.0)
"""Retry at once; for tests and for layers whose caller already paces them."""
