"""Invariants over random stacks: 1-5 layers, in-process or across a header boundary, sync or async,
with fan-out, random failures, lost replies and refused connections.

* arrivals at the target per question key never exceed 1 + the budget the originator set;
* all children of a fan-out together cost at most (children + budget) arrivals;
* the budget seen at the target never exceeds the originator's, and without fan-out siblings it never
  goes up from one attempt to the next.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

import askonce
from askonce.core.backoff import NO_WAIT
from askonce.core.wire import format_reply


@dataclass
class World:
    rng: random.Random
    fail_rate: float
    lost_rate: float  # the callee ran but the reply never came back (read timeout)
    refused_rate: float  # the request never reached the callee
    arrivals: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    budgets: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))

    def target(self) -> str:
        q = askonce.current()
        assert q is not None
        self.arrivals[q.key] += 1
        self.budgets[q.key].append(q.budget)
        if self.rng.random() < self.fail_rate:
            raise ConnectionError("target failed")
        return "ok"


class WireError(ConnectionError):
    pass


def _wire_outcome(world: World, call: askonce.outgoing, serving: askonce.propagation.Serving,
                  error: BaseException | None, result: str | None) -> str:
    """What the client side sees of a call that the server handled: the reply travels as a header."""
    if world.rng.random() < world.lost_rate:
        raise WireError("reply lost")  # leaves `outgoing` unsettled: it fails closed
    call.answered({"askonce-reply": format_reply(serving.reply(error))})
    if error is None:
        assert result is not None
        return result
    raise WireError("callee failed")


def build_sync(world: World, kinds: list[str], fanout: int) -> Callable[[], str]:
    """kinds[i] is how layer i calls layer i+1: 'inproc' or 'wire'. The last layer calls the target."""

    def make(level: int) -> Callable[[], str]:
        if level == len(kinds):
            return world.target
        inner = make(level + 1)
        if kinds[level] == "wire":
            def remote() -> str:
                headers: dict[str, str] = {}
                with askonce.outgoing(headers) as call:
                    if world.rng.random() < world.refused_rate:
                        exc = WireError("refused")
                        exc.askonce_reached = False  # type: ignore[attr-defined]
                        raise exc
                    with askonce.propagation.serve(headers, layer=f"srv{level}") as serving:
                        try:
                            result, error = inner(), None
                        except Exception as e:
                            result, error = None, e
                    return _wire_outcome(world, call, serving, error, result)
            call = remote
        else:
            call = inner
        return askonce.retry(on=ConnectionError, attempts=3, layer=f"l{level}", backoff=NO_WAIT, bucket=None)(call)

    top = make(0)

    def run() -> str:
        if fanout == 1:
            return top()
        for i in range(fanout):
            with askonce.fanout(f"part{i}"), contextlib.suppress(Exception):
                top()
        return "done"

    return run


def build_async(world: World, kinds: list[str], fanout: int) -> Callable[[], Awaitable[str]]:
    async def target() -> str:
        await asyncio.sleep(0)
        return world.target()

    def make(level: int) -> Callable[[], Awaitable[str]]:
        if level == len(kinds):
            return target
        inner = make(level + 1)
        if kinds[level] == "wire":
            async def remote() -> str:
                headers: dict[str, str] = {}
                with askonce.outgoing(headers) as call:
                    if world.rng.random() < world.refused_rate:
                        exc = WireError("refused")
                        exc.askonce_reached = False  # type: ignore[attr-defined]
                        raise exc
                    with askonce.propagation.serve(headers, layer=f"srv{level}") as serving:
                        try:
                            result, error = await inner(), None
                        except Exception as e:
                            result, error = None, e
                    return _wire_outcome(world, call, serving, error, result)
            call = remote
        else:
            call = inner
        return askonce.retry(on=ConnectionError, attempts=3, layer=f"l{level}", backoff=NO_WAIT, bucket=None)(call)

    top = make(0)

    async def run() -> str:
        if fanout == 1:
            return await top()

        async def child(i: int) -> None:
            with askonce.fanout(f"part{i}"), contextlib.suppress(Exception):
                await top()

        await asyncio.gather(*(child(i) for i in range(fanout)))
        return "done"

    return run


stacks = st.lists(st.sampled_from(["inproc", "wire"]), min_size=1, max_size=5)


@settings(max_examples=150, deadline=None)
@given(kinds=stacks, budget=st.integers(0, 4), fanout=st.integers(1, 3), seed=st.integers(0, 2**32 - 1),
       fail_rate=st.sampled_from([0.0, 0.1, 0.5, 1.0]), lost_rate=st.sampled_from([0.0, 0.2]),
       refused_rate=st.sampled_from([0.0, 0.2]), use_async=st.booleans())
def test_arrivals_never_exceed_one_plus_budget(kinds: list[str], budget: int, fanout: int, seed: int,
                                               fail_rate: float, lost_rate: float, refused_rate: float,
                                               use_async: bool) -> None:
    world = World(random.Random(seed), fail_rate, lost_rate, refused_rate)
    for _ in range(3):  # three questions through the same stack
        if use_async:
            run = build_async(world, kinds, fanout)

            async def ask(run: Callable[[], Awaitable[str]] = run) -> None:
                async with askonce.question(budget=budget, deadline=None):
                    with contextlib.suppress(Exception):
                        await run()

            asyncio.run(ask())
        else:
            run_sync = build_sync(world, kinds, fanout)
            with askonce.question(budget=budget, deadline=None), contextlib.suppress(Exception):
                run_sync()
    for key, n in world.arrivals.items():
        assert n <= 1 + budget, (key, n)
        seen = world.budgets[key]
        assert all(b <= budget for b in seen)
        if fanout == 1:  # with siblings, budget one of them held and returned may later serve another
            assert all(a >= b for a, b in itertools.pairwise(seen)), seen
    assert sum(world.arrivals.values()) <= 3 * (fanout + budget)
