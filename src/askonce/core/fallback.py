"""What one process decides alone while the fleet's shared state (a Redis store) cannot be reached.

A process that falls back to local state should keep protecting the target about as the shared
state did, not start over. Two rules:

* **Seeded, not fresh.** The local breaker and bucket start from the shared state the process last
  saw: a breaker seen open stays open until the shared breaker's own ``retry_at``; a bucket seen
  drained stays drained. A breaker seen closed starts closed (with an empty window: the shared
  reply carries no counts).
* **A 1/N share.** N processes fall back together, each on its own. So each gets ``1/N`` of what
  the shared state allowed the fleet: a local breaker waits ``N * open_for`` between its probe
  rounds, and its first round comes at a random point of the first ``(N - 1) * open_for``
  seconds after the shared ``retry_at`` (so that N processes seeded alike do not all probe at
  once); a local bucket refills at ``floor / N`` with ``max_tokens / N`` and starts with ``1/N``
  of the level seen. Over the fleet, about the shared rate.

N (``fleet``) is the larger of the processes last counted sharing the state and a configured
hint, at least 1 and at most ``MAX_FLEET``. Pure: time and the random draw ``u`` are inputs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Final, TypeGuard

from askonce.core import is_int, is_real
from askonce.core.breaker import BreakerPolicy, State
from askonce.core.bucket import BucketPolicy, TokenBucket

__all__ = ["MAX_FLEET", "breaker_share", "bucket_share", "first_probe", "fleet_size",
           "seeded_bucket"]

MAX_FLEET: Final = 10_000


def fleet_size(counted: object, hint: int) -> int:
    """N: the processes counted sharing the state (anything that is not a count reads as 0), or
    ``hint`` when larger; within ``1..MAX_FLEET``."""
    n = counted if is_int(counted) else 0
    return max(1, min(MAX_FLEET, max(n, hint)))


def breaker_share(policy: BreakerPolicy, fleet: int) -> BreakerPolicy:
    """The local breaker's policy: probe rounds ``fleet`` times further apart."""
    if fleet <= 1:
        return policy
    return dataclasses.replace(policy, open_for=policy.open_for * fleet)


def first_probe(seen: State, retry_at: float | None, now: float, open_for: float, fleet: int,
                u: float) -> float | None:
    """When a local breaker seeded with the shared view may first probe; ``None``: start closed.

    ``seen`` and ``retry_at`` are the shared breaker as last seen (``retry_at`` on the caller's
    clock; half-open means its probes are due now). The shared probes were due at
    ``max(retry_at, now)``; this process's share comes ``u * (fleet - 1) * open_for`` later.
    """
    if seen is State.CLOSED:
        return None
    if not 0 <= u < 1:  # written so that NaN fails too
        raise ValueError(f"fallback draw must be within [0, 1), got {u!r}")
    due = now if retry_at is None or not math.isfinite(retry_at) else max(retry_at, now)
    return due + u * (max(1, fleet) - 1) * open_for


def bucket_share(policy: BucketPolicy, fleet: int) -> BucketPolicy:
    """The local bucket's policy: ``1/fleet`` of the shared floor and cap (the ratio is per
    request, so a process's own requests already earn its share)."""
    if fleet <= 1:
        return policy
    return dataclasses.replace(policy, floor=policy.floor / fleet,
                               max_tokens=policy.max_tokens / fleet)


def seeded_bucket(policy: BucketPolicy, now: float, earned: object, floor_tokens: object,
                  fleet: int) -> TokenBucket:
    """A local bucket (``policy`` already the share) holding ``1/fleet`` of the shared level seen:
    ``earned`` and ``floor_tokens`` as the shared bucket last answered. A level that does not read
    (not a finite number >= 0) leaves the bucket as a fresh one would be."""
    bucket = TokenBucket(policy, now)
    n = max(1, fleet)
    if _level(earned):
        bucket.earned = min(policy.max_tokens, earned / n)
    if _level(floor_tokens):
        bucket.floor_tokens = min(bucket.floor_tokens, floor_tokens / n)
    return bucket


def _level(x: object) -> TypeGuard[int | float]:
    return is_real(x) and math.isfinite(x) and x >= 0
