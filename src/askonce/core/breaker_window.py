"""The sliding windows behind :mod:`askonce.core.breaker`: running totals over the last calls.

A count window keeps one byte per call in a ring (the last ``size`` calls); a time window keeps one
bucket of totals per second (the last ``size`` seconds), rolled lazily by ``now``. Both are O(1) per
call and bounded in memory; both can add many fast successes at once (the lock-free path of the
memory store's breaker handle folds them in that way).
"""

from __future__ import annotations

import math
from typing import Final

FAIL: Final = 1
SLOW: Final = 2


class Window:
    """Running totals over the calls still inside the window."""

    __slots__ = ("calls", "failures", "slow")

    def __init__(self) -> None:
        self.calls = 0
        self.failures = 0
        self.slow = 0

    def add(self, now: float, flags: int) -> None:
        raise NotImplementedError

    def add_successes(self, now: float, n: int) -> None:
        """Add ``n`` >= 1 fast successes at ``now``."""
        raise NotImplementedError

    def roll(self, now: float) -> None:
        """Drop what has aged out by ``now``; only time windows age."""

    def reset(self) -> None:
        raise NotImplementedError


class CountWindow(Window):
    __slots__ = ("_filled", "_next", "_ring")

    def __init__(self, size: int) -> None:
        super().__init__()
        self._ring = bytearray(size)  # one flags byte per call: the cheapest bounded history
        self._next = 0
        self._filled = 0

    def add(self, now: float, flags: int) -> None:
        ring = self._ring
        if self._filled == len(ring):
            old = ring[self._next]
            self.calls -= 1
            self.failures -= old & FAIL
            self.slow -= old >> 1
        else:
            self._filled += 1
        ring[self._next] = flags
        self._next = (self._next + 1) % len(ring)
        self.calls += 1
        self.failures += flags & FAIL
        self.slow += flags >> 1

    def add_successes(self, now: float, n: int) -> None:
        ring = self._ring
        size, start, filled = len(ring), self._next, self._filled
        n = min(n, size)  # more successes than the window holds leave nothing but successes
        # While the ring is not full, _next == _filled: the first size - filled slots written are
        # empty, so the calls that leave are the last `evicted` slots of the written range.
        evicted = filled + n - size
        if evicted > 0 and (self.failures or self.slow):
            self._forget(start + n - evicted, evicted)
        end = start + n
        if end <= size:
            ring[start:end] = bytes(n)
        else:
            ring[start:] = bytes(size - start)
            ring[: end - size] = bytes(end - size)
        self._next = end % size
        self._filled = self.calls = min(size, filled + n)

    def _forget(self, start: int, n: int) -> None:
        """Subtract the failed and slow calls among the ``n`` slots from ``start`` (wrapping)."""
        ring, size = self._ring, len(self._ring)
        start %= size
        for lo, hi in ((start, min(start + n, size)), (0, start + n - size)):
            if hi > lo and ring.count(0, lo, hi) < hi - lo:
                both = ring.count(FAIL | SLOW, lo, hi)
                self.failures -= ring.count(FAIL, lo, hi) + both
                self.slow -= ring.count(SLOW, lo, hi) + both

    def reset(self) -> None:
        # O(1): stale bytes are only read as evictions once the ring is full again, and by then
        # every slot has been overwritten.
        self.calls = self.failures = self.slow = 0
        self._next = 0
        self._filled = 0


class TimeWindow(Window):
    __slots__ = ("_b_calls", "_b_failures", "_b_gen", "_b_sec", "_b_slow", "_gen", "_head", "_size")

    def __init__(self, size: int) -> None:
        super().__init__()
        self._size = size
        self._b_calls = [0] * size
        self._b_failures = [0] * size
        self._b_slow = [0] * size
        self._b_sec = [0] * size  # the absolute second a bucket holds
        self._b_gen = [-1] * size  # the reset generation it was written in; -1 = never written
        self._gen = 0
        # The latest second rolled to; the window is (head - size, head].
        self._head: int | None = None

    def roll(self, now: float) -> None:
        self._roll_to(math.floor(now))

    def _roll_to(self, sec: int) -> int:
        head = self._head
        if head is not None and sec <= head:
            return head
        if head is None or sec - head >= self._size:
            self.calls = self.failures = self.slow = 0
        else:
            size = self._size
            for s in range(head + 1, sec + 1):
                i = s % size
                # The bucket that shares s's slot ages out only if it really holds second s - size
                # of this generation; anything older was already dropped by a reset or a long gap.
                if self._b_gen[i] == self._gen and self._b_sec[i] == s - size:
                    self.calls -= self._b_calls[i]
                    self.failures -= self._b_failures[i]
                    self.slow -= self._b_slow[i]
        self._head = sec
        return sec

    def add(self, now: float, flags: int) -> None:
        i = self._bucket(now)
        failed, slow = flags & FAIL, flags >> 1
        self._b_calls[i] += 1
        self._b_failures[i] += failed
        self._b_slow[i] += slow
        self.calls += 1
        self.failures += failed
        self.slow += slow

    def add_successes(self, now: float, n: int) -> None:
        self._b_calls[self._bucket(now)] += n
        self.calls += n

    def _bucket(self, now: float) -> int:
        """The index of ``now``'s bucket, rolled to and cleared if it held an older second."""
        sec = self._roll_to(math.floor(now))
        i = sec % self._size
        if self._b_sec[i] != sec or self._b_gen[i] != self._gen:
            self._b_calls[i] = self._b_failures[i] = self._b_slow[i] = 0
            self._b_sec[i] = sec
            self._b_gen[i] = self._gen
        return i

    def reset(self) -> None:
        # O(1): bumping the generation orphans every bucket, which add() and roll() then ignore.
        self._gen += 1
        self.calls = self.failures = self.slow = 0
