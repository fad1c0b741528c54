"""The simulator's hedging (Policy.hedge, sim/hedging.py) in the tail scenario (E12): the goal of
issue 13 on virtual time, and the bounds every question keeps."""

from __future__ import annotations

import pytest

from askonce.core.hedge import HedgePolicy
from askonce.sim.model import Sim
from askonce.sim.scenarios import Knobs, preset, tail
from askonce.sim.world import Policy, World


@pytest.mark.parametrize("depth", [1, 3])
def test_hedging_cuts_the_tail_five_times_at_a_few_percent_more_arrivals(depth: int) -> None:
    rows = {r.policy: r for r in tail(depths=(depth,), duration=4.0,
                                      policies=("askonce", "askonce-hedge"))}
    plain, hedged = rows["askonce"], rows["askonce-hedge"]
    assert plain.latency_p99_ms is not None and hedged.latency_p99_ms is not None
    assert plain.latency_p99_ms >= 5 * hedged.latency_p99_ms
    assert hedged.arrivals <= 1.05 * hedged.questions
    assert plain.max == 1 and hedged.max == 2  # within 1 + budget (2) for every question
    assert hedged.success_rate >= plain.success_rate
    assert hedged.latency_p50_ms == plain.latency_p50_ms  # the median call never hedges


def test_every_hedge_is_the_layers_second_try_and_costs_the_budget_one() -> None:
    world = World(depth=1, clients=2, rate=500.0, duration=2.0, service=0.01, spread=0.5,
                  slow_share=0.02, slow_time=0.2, timeout=1.0, settle=0.0)
    sim = Sim(world, preset("askonce-hedge", Knobs(budget=1)), seed=3, trace=True)
    sim.run()
    assert sim.hedging is not None and sim.hedging.sent > 0
    arrivals = [n for _, n in sim.stats.trace or []]
    assert len(arrivals) == sim.stats.issued  # every question closed, the losing hedges counted
    assert max(arrivals) == 2 and sum(arrivals) == sim.stats.issued + sim.hedging.sent
    report = sim.ledger.report(sim.engine.now).totals()
    assert report.retries_by == {"layer1": sim.hedging.sent}  # hop layer1:2, as the ledger sees it


def test_without_budget_nothing_is_hedged() -> None:
    world = World(depth=1, clients=2, rate=500.0, duration=2.0, service=0.01, spread=0.5,
                  slow_share=0.02, slow_time=0.2, settle=0.0)
    sim = Sim(world, preset("askonce-hedge", Knobs(budget=0)), seed=3)
    sim.run()
    assert sim.hedging is not None and sim.hedging.sent == 0
    assert sim.stats.arrivals == sim.stats.issued


def test_hedging_needs_the_question_to_travel() -> None:
    with pytest.raises(ValueError, match=r"^hedge must be a HedgePolicy, with propagate=True"):
        Policy("naive", hedge=HedgePolicy())
