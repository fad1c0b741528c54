"""The simulator's fast paths give what the slow ones give: the first attempt made without the
library's loop, the tuple-built ``Tried``; and a run keeps no per-question state past its
questions' end."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from askonce._loop import Tried
from askonce.core.retry import ANSWERED, Failure
from askonce.core.verdict import health
from askonce.core.wire import Reply
from askonce.sim.model import Asked, Call, Sim
from askonce.sim.scenarios import Knobs, preset
from askonce.sim.world import Stats, World


class LoopSim(Sim):
    """Every first attempt through the loop, as before the fast path."""

    _first_without_loop = False


def _figures(sim: Sim) -> dict[str, Any]:
    stats = sim.run()
    figures = {name: getattr(stats, name) for name in Stats.__slots__}
    figures["events"] = sim.engine.events
    return figures


WORLDS = {
    "errors": {"error_rate": 0.2},
    "slow": {"error_rate": 0.05, "timeout": 0.05, "slow_share": 0.1, "slow_time": 0.2,
             "servers": 20},
    "outage": {"outage": (0.5, 1.5), "timeout": 0.2, "servers": 10, "horizon": 3.0},
}
POLICIES = ("naive", "bucket", "breaker", "askonce", "askonce-join", "askonce-async",
            "askonce-hedge")


@pytest.mark.parametrize("world", sorted(WORLDS))
@pytest.mark.parametrize("policy", POLICIES)
def test_first_attempt_without_the_loop_changes_nothing(world: str, policy: str) -> None:
    w = World(depth=3, clients=10, rate=300.0, duration=2.0, settle=0.5, **WORLDS[world])
    fast = Sim(w, preset(policy, Knobs()), 5, trace=True)
    slow = LoopSim(w, preset(policy, Knobs()), 5, trace=True)
    got, want = _figures(fast), _figures(slow)
    assert want["issued"] > 0 and want["arrivals"] > 0
    assert got == want


def test_the_written_out_draws_are_the_random_modules() -> None:
    """``Sim.on_issue`` draws a gap and a key's bytes without calling ``expovariate`` and
    ``randbytes``: the same numbers from the same stream."""
    ours, theirs = random.Random(4), random.Random(4)
    for rate in (0.5, 1000.0, 1e6):
        for _ in range(2000):
            assert -math.log(1.0 - ours.random()) / rate == theirs.expovariate(rate)
            assert ours.getrandbits(128).to_bytes(16, "little") == theirs.randbytes(16)


def test_an_answered_try_is_the_tried_the_loop_expects() -> None:
    sim = Sim(World(depth=1, clients=1, rate=1.0, duration=1.0), preset("askonce", Knobs()))
    child = Call(Asked("k", 0, 0.0, 1.0), None, None)
    child.ok, child.reply = True, Reply(1)
    tried = sim._tried(child)
    assert tried == Tried(None, True, Reply(1), ANSWERED)
    assert type(tried) is Tried
    for reply in (Reply(1), Reply(0, True, "overloaded", 1.0), Reply(2, True, "deadline")):
        child.ok, child.reply = False, reply
        failed = sim._tried(child)
        assert failed == Tried(Failure(True, reply, ANSWERED), health(True, reply), reply,
                               ANSWERED)
        assert type(failed) is Tried


@pytest.mark.parametrize("policy", ["naive", "askonce", "askonce-hedge"])
def test_no_per_question_state_outlives_the_run(policy: str) -> None:
    """Memory that grows with the questions would show here as something left over: the heap,
    the queue and the runs empty, and every container of the figures sized by the world (bins,
    latencies, arrival counts), not by how many questions were asked."""
    sizes = []
    for rate in (200.0, 800.0):
        w = World(depth=3, clients=10, rate=rate, duration=3.0, error_rate=0.2, timeout=0.05,
                  slow_share=0.05, slow_time=0.1)
        sim = Sim(w, preset(policy, Knobs()), 3)
        stats = sim.run()
        assert len(sim.engine) == 0 and not sim.queue and not sim._runs
        assert stats.trace is None
        sizes.append((len(stats.issued_bins), len(stats.arrival_bins), len(stats.goodput_bins)))
        assert len(stats.latency_ms) <= w.deadline * 1000 + 1
        assert len(stats.hist) <= 3 ** 3 + 1
    assert sizes[0] == sizes[1]
