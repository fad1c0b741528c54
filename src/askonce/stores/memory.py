"""The in-memory store: per-target retry token buckets shared by every call in this process.

Deposits (one per first attempt) take no lock: a deposit lost to a thread race only makes the bucket
more conservative. Withdrawals, which decide whether a retry happens, are made under a lock. The number
of targets is bounded; past it the least recently created bucket is dropped (counted as
``store.memory.evicted``), so a caller that keys by unbounded names cannot grow memory without end.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from askonce.context import count
from askonce.core.bucket import BucketPolicy, TokenBucket


class BucketHandle:
    """One target's bucket as a shell sees it."""

    __slots__ = ("_bucket", "_lock", "target")

    def __init__(self, target: str, bucket: TokenBucket, lock: threading.Lock) -> None:
        self.target = target
        self._bucket = bucket
        self._lock = lock

    def deposit(self) -> None:
        self._bucket.requests += 1

    def withdraw(self, now: float) -> bool:
        with self._lock:
            return self._bucket.withdraw(now)

    def tokens(self, now: float) -> float:
        with self._lock:
            return self._bucket.tokens(now)


class MemoryStore:
    def __init__(self, clock: Callable[[], float], max_targets: int = 4096) -> None:
        if max_targets < 1:
            raise ValueError("max_targets must be at least 1")
        self._clock = clock
        self._max = max_targets
        self._lock = threading.Lock()
        self._buckets: OrderedDict[tuple[str, BucketPolicy], BucketHandle] = OrderedDict()

    def bucket(self, target: str, policy: BucketPolicy) -> BucketHandle:
        key = (target, policy)
        handle = self._buckets.get(key)
        if handle is not None:
            return handle
        with self._lock:
            handle = self._buckets.get(key)
            if handle is None:
                handle = BucketHandle(target, TokenBucket(policy, self._clock()), self._lock)
                self._buckets[key] = handle
                if len(self._buckets) > self._max:
                    self._buckets.popitem(last=False)
                    count("store.memory.evicted")
            return handle
