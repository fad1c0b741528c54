"""The simulator's event loop: a FIFO beside the heap runs events in the heap's own order."""

from __future__ import annotations

import random
from heapq import heappush
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from askonce.sim.engine import Engine

LATENCY = 0.25


def replay(seed: int, use_fifo: bool, until: float) -> list[tuple[float, int]]:
    """Events that schedule more, by a seeded draw: a hop's latency ahead (the FIFO, or the heap
    when ``use_fifo`` is off), any delay ahead, zero delay, or ties on the same instant."""
    engine, rng, order = Engine(), random.Random(seed), []
    labels = iter(range(1_000_000))

    def handler(label: int) -> None:
        order.append((engine.now, label))
        if len(order) > 400:
            return
        for _ in range(rng.randrange(3)):
            kind, child = rng.randrange(4), next(labels)
            if kind == 0:  # a hop's latency ahead
                event = (engine.now + LATENCY, next(engine.seq), handler, child)
                (engine.fifo.append if use_fifo else push)(event)
            elif kind == 1:
                engine.at(engine.now + rng.choice((0.0, LATENCY, 0.1, 1.0)), handler, child)
            elif kind == 2:
                engine.after(rng.random(), handler, child)
            else:
                engine.after(0.0, handler, child)

    def push(event: Any) -> None:
        heappush(engine.heap, event)

    for _ in range(3):
        engine.at(rng.choice((0.0, 0.5)), handler, next(labels))
    engine.run(until)
    return order


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32), st.sampled_from([float("inf"), 2.0, 0.75]))
def test_the_fifo_beside_the_heap_runs_events_in_the_heap_s_order(seed: int, until: float) -> None:
    assert replay(seed, True, until) == replay(seed, False, until)
