"""The event loop: a binary heap of ``(time, seq, fn, arg)`` on a virtual clock, and a FIFO beside
it for the events a constant delay after their scheduling (a hop's latency), which come in order.

Nothing sleeps and nothing runs on a thread: ``run`` pops the earliest event, sets ``now`` to its
time and calls ``fn(arg)``, which may schedule more. ``seq`` breaks ties in scheduling order, so a
run is a pure function of its inputs and its seed.

Why not SimPy: its process-per-generator model allocates a generator, a process and an event
object per step; a plain heap allocates only the event's tuple. Callers pass pre-bound methods as
``fn`` so that scheduling an event allocates nothing more.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Iterator
from heapq import heappush
from itertools import chain, count
from typing import Any

Handler = Callable[[Any], None]
Event = tuple[float, int, Handler, Any]


class Engine:
    """A virtual clock and its pending events.

    ``seq`` comes from a C-level counter (``itertools.count``), so a caller on the hot path may
    push ``(when, next(engine.seq), fn, arg)`` onto ``engine.heap`` itself, as ``at`` does, without
    a Python-level call. Events a constant delay after ``now`` (the model's hop latency) may go to
    ``engine.fifo`` instead: pushed in the order they run, they need no heap; ``run`` takes the
    earlier of the two heads, by ``(time, seq)``, so the order is the heap's alone would be.
    """

    __slots__ = ("_read", "fifo", "heap", "now", "seq")

    def __init__(self, start: float = 0.0) -> None:
        self.heap: list[Event] = []
        # ``(time, seq)`` never decreases along it: only ``now`` plus one constant delay goes here
        self.fifo: deque[Event] = deque()
        self.seq = count(1)
        self._read = 0  # numbers ``events`` took from ``seq`` (a gap in seq changes no order)
        self.now = start

    @property
    def events(self) -> int:
        """How many events have been scheduled so far (a measure of the work a run did). Reading
        it takes a number from ``seq``: the count stays right, and a gap changes no order."""
        self._read += 1
        return next(self.seq) - self._read

    def at(self, when: float, fn: Handler, arg: Any) -> None:
        """Call ``fn(arg)`` at virtual time ``when``, which must not be before ``now`` (the model
        only schedules ``now`` plus a delay; checking it here would cost every event a
        comparison)."""
        heappush(self.heap, (when, next(self.seq), fn, arg))

    def after(self, delay: float, fn: Handler, arg: Any) -> None:
        heappush(self.heap, (self.now + delay if delay > 0 else self.now, next(self.seq), fn, arg))

    def run(self, until: float = math.inf) -> None:
        """Process events in time order until none is left or the next is later than ``until``."""
        heap, fifo, pop, popleft = self.heap, self.fifo, heapq.heappop, self.fifo.popleft
        if until == math.inf:  # no horizon: no comparison with it per event
            while True:
                if fifo:
                    when, _, fn, arg = pop(heap) if heap and heap[0] < fifo[0] else popleft()
                elif heap:
                    when, _, fn, arg = pop(heap)
                else:
                    return
                self.now = when
                fn(arg)
        while heap or fifo:
            from_heap = not fifo or (heap and heap[0] < fifo[0])
            if (heap[0] if from_heap else fifo[0])[0] > until:
                self.now = until
                return
            when, _, fn, arg = pop(heap) if from_heap else popleft()
            self.now = when
            fn(arg)

    def pending(self) -> Iterator[Any]:
        """The arguments of the events not yet run (to account for work a horizon cut off)."""
        return (item[3] for item in chain(self.heap, self.fifo))

    def __len__(self) -> int:
        return len(self.heap) + len(self.fifo)
