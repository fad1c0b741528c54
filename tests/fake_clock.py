"""A clock the test sets by hand, and the breaker policy the breaker tests run it against."""

from __future__ import annotations

from askonce.core.breaker import BreakerPolicy, State

CLOSED, OPEN, HALF = State.CLOSED, State.OPEN, State.HALF_OPEN
POLICY = BreakerPolicy(window_size=10, minimum_calls=4, failure_rate=0.5, open_for=5.0, half_open_probes=1)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now
