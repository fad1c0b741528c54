"""A per-client retry token bucket: retries limited to a ratio of requests plus a small floor.

This is the shape of gRPC's retry throttling and Finagle's ``RetryBudget``: every request a client
makes to a target earns ``ratio`` of a retry token (so in a full outage at most ``ratio`` of the
load is retries), and a small ``floor`` of retries per second is always allowed so that a quiet
client can still retry its rare failures. Earned tokens are capped, so a long healthy period cannot
bank a storm.

The bucket is a pure state machine (time is an input). Deposits only count requests, so the shells
can make them without a lock; withdrawals settle the count under the shell's lock.
"""

from __future__ import annotations

from askonce.core import is_real
from askonce.core.record import Record


class BucketPolicy(Record):
    """How many retries a client may make to one target: ``ratio`` per request plus a ``floor``."""

    __slots__ = __match_args__ = ("ratio", "floor", "max_tokens")
    # Retry tokens earned per request. 0.2 is Finagle's default: at 10 % transient failures every
    # failure needs ~0.11 tokens per request, so a 0.1 ratio throttles legitimate retries
    # (docs/results.md, E2).
    ratio: float
    floor: float  # retries per second always allowed, refilled continuously
    max_tokens: float  # cap on earned tokens

    def __init__(self, ratio: float = 0.2, floor: float = 10.0, max_tokens: float = 100.0) -> None:
        _set = object.__setattr__
        _set(self, "ratio", ratio)
        _set(self, "floor", floor)
        _set(self, "max_tokens", max_tokens)
        self.__post_init__()

    def __post_init__(self) -> None:
        for name in ("ratio", "floor", "max_tokens"):
            value = getattr(self, name)
            if not is_real(value):  # True would be a ratio of 1
                raise ValueError(f"bucket {name} must be a number, got {value!r}")
        if not 0 <= self.ratio <= 10:
            raise ValueError(f"bucket ratio must be within 0..10, got {self.ratio!r}")
        if not 0 <= self.floor <= 1e6:
            raise ValueError(f"bucket floor must be within 0..1e6 per second, got {self.floor!r}")
        if not 0 <= self.max_tokens <= 1e9:
            raise ValueError(f"bucket max_tokens must be within 0..1e9, got {self.max_tokens!r}")


class TokenBucket:
    """The state of one client's bucket for one target."""

    __slots__ = ("_settled", "_updated", "earned", "floor_tokens", "policy", "requests")

    def __init__(self, policy: BucketPolicy, now: float) -> None:
        self.policy = policy
        self.requests = 0  # requests counted so far (deposits)
        self._settled = 0  # requests already turned into earned tokens
        self.earned = 0.0
        self.floor_tokens = self._floor_cap()  # a fresh client may retry at the floor rate at once
        self._updated = now

    def _floor_cap(self) -> float:
        # At least one whole token, or a floor below one retry per second could never be used.
        return max(1.0, self.policy.floor) if self.policy.floor > 0 else 0.0

    def deposit(self, n: int = 1) -> None:
        self.requests += n

    def _settle(self, now: float) -> None:
        p = self.policy
        new = self.requests - self._settled
        if new:
            self.earned = min(p.max_tokens, self.earned + new * p.ratio)
            self._settled = self.requests
        if now > self._updated:
            self.floor_tokens = min(self._floor_cap(),
                                    self.floor_tokens + (now - self._updated) * p.floor)
            self._updated = now

    def tokens(self, now: float) -> float:
        self._settle(now)
        return self.earned + self.floor_tokens

    def at_rest(self, now: float) -> bool:
        """At least as generous as a new bucket (its floor is full): forgetting it gives a caller no
        retry it could not already make. A store evicts such buckets before drained ones."""
        self._settle(now)
        return self.floor_tokens >= self._floor_cap()

    def withdraw(self, now: float) -> bool:
        """Take one retry token if there is one."""
        self._settle(now)
        if self.earned >= 1.0:
            self.earned -= 1.0
            return True
        if self.floor_tokens >= 1.0:
            self.floor_tokens -= 1.0
            return True
        return False
