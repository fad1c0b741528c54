"""The simulator's async mode (``Policy.respond_async``) and E13, a target slower than every
layer's timeout: 202 at once, long-polls of the status location counted apart from arrivals, a 404
failing closed, polls bounded by the deadline. Virtual time: every figure is exact."""

from __future__ import annotations

import math

import pytest

from askonce.core.bucket import BucketPolicy
from askonce.sim.model import POLL_GAP, Sim
from askonce.sim.scenarios import Knobs, preset, stuck
from askonce.sim.world import Policy, World

# Only the budget limits retries: tries for all of it, no admission, a bucket that never runs dry.
FREE = Knobs(attempts=4, budget=3, concurrency=None, admission=None,
             bucket=BucketPolicy(ratio=1.0, floor=1000.0, max_tokens=1000.0))


@pytest.mark.parametrize("slow_time", [3.0, 5.0])
def test_e13_async_answers_every_question_once_and_joins_as_far_as_its_re_attaches_reach(
        slow_time: float) -> None:
    rows = {r.policy: r for r in stuck(slow_times=(slow_time,), duration=1.0)}
    naive, none, alone = rows["naive"], rows["no-retry"], rows["askonce"]
    joined, later = rows["askonce-join"], rows["askonce-async"]
    n = later.questions
    assert n > 50
    # Naive layers multiply (3 tries of 1 s at each of 3 layers) and still answer nothing.
    assert naive.success_rate == 0.0 and naive.max == naive.p99 == 27
    assert naive.work_s == pytest.approx(27 * slow_time * naive.questions)
    assert none.success_rate == 0.0 and alone.success_rate == 0.0
    # askonce-join keeps the transport's timeout and re-attaches every second (admission neither
    # sheds a re-attach nor counts a lost one: it adds no work): its 1 + budget tries reach the
    # answer of a 3 s call, the work done once, and not that of a 5 s one.
    assert joined.max is not None and joined.max <= 4
    if slow_time <= 3.0:
        assert joined.success_rate > 0.95
        assert joined.work_s == pytest.approx(slow_time * joined.questions, rel=0.01)
    else:
        assert joined.success_rate < 0.05
    # Async: one arrival and the work done once per question, every question answered.
    assert later.success_rate == 1.0 and later.max == 1 and later.arrivals == n
    assert later.work_s == pytest.approx(slow_time * n)
    assert later.wasted_s == 0.0
    # Each of the 3 layers polls its callee once a second (a 1 s timeout leaves no whole second
    # to hold a poll for) until the work below it is done: the answer comes up a layer a poll.
    assert later.polls == later.poll_max * n
    assert 3 * slow_time / POLL_GAP <= later.poll_max <= 3 * (slow_time + 3) / POLL_GAP
    assert later.latency_p99_ms is not None
    assert later.latency_p99_ms <= 1000 * (slow_time + 3 * POLL_GAP)
    assert all(r.polls == 0 for r in rows.values() if r is not later)


def test_polls_are_never_arrivals_at_the_targets_ledger() -> None:
    world = World(depth=3, clients=5, rate=50.0, duration=1.0, timeout=1.0, deadline=10.0,
                  transport_timeout=True, service=2.5, settle=0.0)
    sim = Sim(world, preset("askonce-async", Knobs(budget=3, concurrency=None)), seed=2)
    stats = sim.run()
    totals = sim.ledger.report(sim.engine.now).totals()
    assert stats.polls > stats.issued > 0
    assert totals.arrivals == stats.arrivals == stats.issued
    assert stats.hist == {1: stats.issued} and stats.ok == stats.issued


def test_join_without_async_answers_while_its_re_attaches_cover_the_work() -> None:
    # A layer re-attaches each second of its transport timeout: its 3 tries cover a 2.5 s call, at
    # one arrival per try at the target (1 + 2 re-attaches), not a 5 s one. Async polls cover both.
    knobs = Knobs(budget=3, admission=None)
    rows = {(r.params["slow_time"], r.policy): r
            for r in stuck(slow_times=(2.5, 5.0), duration=0.5, knobs=knobs,
                           policies=("askonce-join", "askonce-async"))}
    short, long = rows[2.5, "askonce-join"], rows[5.0, "askonce-join"]
    assert short.success_rate == 1.0 and short.max == 3 and short.work_s == pytest.approx(
        2.5 * short.questions)
    assert long.success_rate == 0.0 and long.max == 3
    for slow_time in (2.5, 5.0):
        later = rows[slow_time, "askonce-async"]
        assert later.success_rate == 1.0 and later.max == 1


def test_with_an_attempt_timeout_joining_layers_wait_and_async_adds_only_polls_and_latency(
        ) -> None:
    rows = {r.policy: r for r in stuck(slow_times=(3.0,), duration=0.5, transport=False,
                                       policies=("askonce-join", "askonce-async"))}
    joined, later = rows["askonce-join"], rows["askonce-async"]
    for r in (joined, later):
        assert r.success_rate == 1.0 and r.max == 1
    assert joined.polls == 0 and later.polls > 0 and joined.work_s == later.work_s
    # A poll that cannot be held (a 1 s timeout) comes back a second later: up to a second a layer.
    assert joined.latency_p99_ms is not None and later.latency_p99_ms is not None
    assert joined.latency_p99_ms < later.latency_p99_ms <= joined.latency_p99_ms + 3 * 1000


def test_a_poll_that_finds_no_run_fails_closed() -> None:
    # The target fails at once (no work): its run is over, and not kept, before the poll comes:
    # 404, and the try is settled as lost, never retried (the run may have done the work).
    world = World(depth=1, clients=1, rate=50.0, duration=1.0, timeout=1.0, deadline=5.0,
                  service=0.0, outage=(0.0, 1e12), settle=0.0)
    later = Sim(world, preset("askonce-async", FREE), seed=1).run()
    assert later.hist == {1: later.issued} and later.ok == 0
    assert later.polls == later.issued  # one poll each: 404
    # Without async the same failure comes back as an answer, and the budget retries it.
    joined = Sim(world, preset("askonce-join", FREE), seed=1).run()
    assert joined.hist == {4: joined.issued}


def test_a_poll_held_when_the_run_fails_gets_the_failure_and_the_budget_retries() -> None:
    # A 2 s timeout: each poll asks to be held 1 s, and is held when the run fails.
    world = World(depth=2, clients=1, rate=50.0, duration=1.0, timeout=2.0, deadline=5.0,
                  service=0.05, outage=(0.0, 1e12), settle=0.0)
    stats = Sim(world, preset("askonce-async", FREE), seed=1).run()
    assert stats.ok == 0 and max(stats.hist) == 1 + 3 and stats.polls > 0


def test_polls_stop_at_the_deadline() -> None:
    # Work longer than the question's deadline: the target (workers enough for every arrival)
    # cancels it there, and no layer polls past it.
    world = World(depth=3, clients=2, rate=40.0, duration=1.0, timeout=1.0, deadline=3.0,
                  transport_timeout=True, service=5.0, servers=1000, settle=0.0)
    sim = Sim(world, preset("askonce-async", Knobs(budget=3, concurrency=None)), seed=1)
    stats = sim.run()
    assert stats.ok == 0 and stats.hist == {1: stats.issued}
    assert stats.busy <= 3.0 * stats.issued
    assert 0 < stats.poll_max <= 3 * (math.ceil(world.deadline / POLL_GAP) + 1)


def test_async_runs_are_deterministic_and_read_what_the_wire_would_carry() -> None:
    world = World(depth=3, clients=4, rate=60.0, duration=1.0, timeout=1.0, deadline=6.0,
                  transport_timeout=True, service=0.02, slow_share=0.5, slow_time=2.5,
                  error_rate=0.2, settle=0.0)
    policy = preset("askonce-async", Knobs(budget=3))
    a, b = Sim(world, policy, seed=4).run(), Sim(world, policy, seed=4).run()
    text = Sim(world, policy, seed=4, wire_text=True).run()
    for name in ("issued", "ok", "arrivals", "hist", "polls", "poll_max", "busy", "latency_ms"):
        assert getattr(a, name) == getattr(b, name) == getattr(text, name), name
    assert a.polls > 0 and a.ok > 0


@pytest.mark.parametrize("kwargs", [
    {"respond_async": True},  # no join
    {"respond_async": True, "join": True},  # no question travels
    {"respond_async": 1, "join": True, "propagate": True},
])  # fmt: skip
def test_async_mode_needs_a_joining_propagating_stack(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="respond_async"):
        Policy("askonce", **kwargs)  # type: ignore[arg-type]
