"""``askonce demo``: the pure pieces, then the real thing (``--quick --json``) and its clean-up.

The end-to-end test runs the demo as a subprocess, exactly as a user would, and checks the JSON schema,
the headline inequalities and that every process it started is gone afterwards. The clean-up tests
interrupt a demo (SIGINT) and kill one outright (SIGKILL): its children must not outlive it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from askonce.demo import measure, naive, params, runner
from askonce.demo.edge import Asked
from askonce.demo.main import lanes
from askonce.demo.params import (
    LayerSettings,
    TargetSettings,
    capacity_factor,
    draw,
    from_json,
    poisson_schedule,
    question_keys,
    scenarios,
)
from askonce.demo.target import Pool
from cli_run import one_line_error, run_cli
from redis_server import RedisServer

DEMO = [sys.executable, "-m", "askonce", "demo"]


# --- pure pieces ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("values", "q", "expected"), [
    ([], 0.5, None),
    ([7], 0.99, 7),
    ([1, 2, 3, 4], 0.5, 2),
    (list(range(1, 101)), 0.99, 99),
    (list(range(1, 101)), 1.0, 100),
    ([27] * 99 + [1], 0.99, 27),
])  # fmt: skip
def test_percentile_is_nearest_rank(values: list[int], q: float, expected: float | None) -> None:
    assert measure.percentile(values, q) == expected


def test_percentile_refuses_a_share_outside_0_1() -> None:
    with pytest.raises(ValueError):
        measure.percentile([1], 0)


def _answered(schedule: list[float], ok: Any, latency: float = 0.05) -> list[Asked]:
    out = []
    for i, t in enumerate(schedule):
        good = ok(t)
        out.append(Asked(f"k{i}", t, t, t + latency, 200 if good else 504))
    return out


def test_recovery_time_is_the_first_window_back_to_90_percent() -> None:
    schedule = [i / 50 for i in range(50 * 30)]  # 50 questions a second for 30 s
    # answered until the cut at 5 s, nothing from 5 s to 17.3 s, answered again after
    asked = _answered(schedule, lambda t: not 5 <= t < 17.3)
    got = measure.recovery_time(asked, 3.0, baseline=(1, 5), trigger_end=15, horizon=30, window=5)
    assert got == 2.0  # of those asked in [16.5, 21.5) 84 % were answered, in [17.0, 22.0) 94 %


def test_recovery_is_judged_on_the_questions_asked_in_each_window() -> None:
    # A burst asked just before the baseline and answered within it: counting answers that came
    # back in a window would make "before" 3.7 times what any window can reach.
    schedule = [i / 50 for i in range(50 * 30)]
    asked = _answered(schedule, lambda t: True)
    asked += [Asked(f"b{i}", 0.6, 0.6, 0.9, 200) for i in range(100)]
    got = measure.recovery_time(asked, 3.0, baseline=(0.75, 1.5), trigger_end=15, horizon=30,
                                window=5)
    assert got == 0.0


def test_a_question_still_open_at_the_horizon_counts_only_once_its_deadline_passed() -> None:
    # Every answer takes 1 s; the run stops at 20 s with the last second's questions still open.
    # Their 3 s deadline had not passed, so they say nothing; counted as failures they would take
    # [15, 20) to 80 %. A question open past its deadline is a failure.
    schedule = [i / 50 for i in range(50 * 20)]
    asked = [a if a.scheduled < 19 else Asked(a.key, a.scheduled, a.scheduled)
             for a in _answered(schedule, lambda t: True, latency=1.0)]
    got = measure.recovery_time(asked, 3.0, baseline=(1, 5), trigger_end=15, horizon=20, window=5)
    assert got == 0.0
    stuck = [a if a.scheduled < 15 else Asked(a.key, a.scheduled, a.scheduled) for a in asked]
    assert measure.recovery_time(stuck, 3.0, baseline=(1, 5), trigger_end=15, horizon=30,
                                 window=5) is None


def test_recovery_time_is_none_when_goodput_never_returns_within_the_horizon() -> None:
    schedule = [i / 50 for i in range(50 * 30)]
    asked = _answered(schedule, lambda t: t < 5)
    assert measure.recovery_time(asked, 3.0, baseline=(1, 5), trigger_end=15, horizon=30, window=5) is None
    # and a horizon too short for a single window says nothing either
    healthy = _answered(schedule, lambda t: True)
    assert measure.recovery_time(healthy, 3.0, baseline=(1, 5), trigger_end=15, horizon=19, window=5) is None
    assert measure.recovery_time(healthy, 3.0, baseline=(1, 5), trigger_end=15, horizon=20, window=5) == 0.0


def test_recovery_counts_late_answers_as_failures() -> None:
    schedule = [i / 50 for i in range(50 * 30)]
    asked = _answered(schedule, lambda t: True, latency=3.5)  # every answer comes after the 3 s deadline
    assert measure.recovery_time(asked, 3.0, baseline=(1, 5), trigger_end=15, horizon=30, window=5) is None


def test_wasted_work_keeps_only_the_piece_that_answered_each_question() -> None:
    asked = [Asked("a", 0, 0, 1.0, 200), Asked("b", 0, 0, 1.0, 503), Asked("c", 0, 0, 5.0, 200)]
    work = [
        ("a", 0.4, 0.4),  # a's first try: its caller timed out and retried
        ("a", 0.95, 0.1),  # the try that answered a
        ("a", 2.0, 1.0),  # an orphaned retry that finished after a was answered
        ("b", 0.5, 0.2),  # b failed: all of its work was for nothing
        (None, 0.5, 0.3),  # no question id at all
    ]  # fmt: skip
    assert measure.wasted_work(asked, work, deadline=3.0) == pytest.approx(0.4 + 1.0 + 0.2 + 0.3)
    # c was answered after its deadline: not in time, so not useful either
    assert measure.wasted_work(asked, [("c", 4.9, 1.0)], deadline=3.0) == pytest.approx(1.0)


def test_the_load_schedule_is_seeded_poisson() -> None:
    a = poisson_schedule(100, 20, seed=7)
    assert a == poisson_schedule(100, 20, seed=7)
    assert a != poisson_schedule(100, 20, seed=8)
    assert all(0 <= t < 20 for t in a) and a == sorted(a)
    assert 1800 < len(a) < 2200  # 2000 expected; sd 45
    gaps = [y - x for x, y in itertools.pairwise(a)]
    assert 0.009 < sum(gaps) / len(gaps) < 0.011


def test_question_keys_are_askonce_keys_shared_by_the_policies_of_a_scenario() -> None:
    keys = question_keys(50, 1, "outage")
    assert keys == question_keys(50, 1, "outage") and len(set(keys)) == 50
    assert keys != question_keys(50, 1, "transient")
    import askonce

    with askonce.question(key=keys[0]) as q:  # the wire accepts them
        headers: dict[str, str] = {}
        askonce.propagation.inject(headers)
    assert askonce.propagation.extract(headers) is not None and q.key == keys[0]


def test_the_targets_draws_are_independent_of_order_and_about_uniform() -> None:
    keys = question_keys(20_000, 3, "transient")
    draws = [draw(3, "fail", k, 1) for k in keys]
    assert all(0 <= d < 1 for d in draws)
    assert 0.09 < sum(d < 0.1 for d in draws) / len(draws) < 0.11
    assert draw(3, "fail", keys[0], 1) == draws[0] != draw(3, "fail", keys[0], 2)


@pytest.mark.parametrize(("t", "factor"), [(0.0, 1.0), (2.99, 1.0), (3.0, 0.2), (12.99, 0.2), (13.0, 1.0)])
def test_the_capacity_schedule(t: float, factor: float) -> None:
    assert capacity_factor(((3.0, 13.0, 0.2),), t) == factor


def test_scenario_parameters_hold_together() -> None:
    for quick in (False, True):
        s = scenarios(quick)
        assert list(s) == ["outage", "transient", "slow", "tail", "overload", "stuck"]
        o = s["overload"]
        assert o.trigger is not None and o.trigger.factor == 0.2
        assert o.rate == pytest.approx(0.8 * o.target.slots / o.target.service_time)  # load 0.8 of capacity
        assert o.deadline == 3.0 and o.edge_timeout == 1.0 and o.edge_attempts == 4
        assert o.trigger.end + o.window <= o.duration  # at least one recovery window fits
        assert s["slow"].target.slow_time > s["slow"].layer_timeout  # slow calls outlast the timeout
        t = s["tail"]  # 2 % take 20x the median, no timeout that short, a target that does not join
        assert t.target.slow_time == 20 * t.target.service_time and t.target.slow_share == 0.02
        assert t.target.slow_time < min(t.layer_timeout, t.deadline) and t.hedge and not t.join
        # the real stack's slow calls: 20x its measured median, still within every timeout
        assert t.slow_factor == 20 and min(t.layer_timeout, t.deadline, t.edge_timeout) > runner.MAX_SLOW
        assert all(x.slow_factor is None for n, x in s.items() if n != "tail")
        k = s["stuck"]  # every call outlasts every layer's timeout, not the deadline; async mode
        assert k.target.failure == "none" and k.layer_timeout < k.target.service_time < k.deadline
        assert k.respond_async and k.join and k.policies == ("no-retry", "naive", "askonce")
    assert not scenarios(join=False)["stuck"].respond_async  # async mode is a joining callee's
    assert scenarios()["overload"].trigger.length == 10.0  # type: ignore[union-attr]


def test_every_run_has_the_one_stack_to_itself() -> None:
    # A second stack beside it would share the CPU: the figures would measure the machine.
    for quick in (False, True):
        (plan,) = lanes(scenarios(quick))
        assert [(s.name, p) for s, p in plan] == [
            *((n, p) for n in ("outage", "transient", "slow", "tail") for p in ("naive", "askonce")),
            ("overload", "no-retry"), ("overload", "askonce"), ("overload", "naive"),
            ("stuck", "no-retry"), ("stuck", "naive"), ("stuck", "askonce")]


def test_settings_from_json_refuse_what_they_do_not_know() -> None:
    s = LayerSettings(mode="askonce", downstream="http://127.0.0.1:1", breaker=True)
    assert from_json(LayerSettings, json.loads(json.dumps(s.to_json()))) == s
    t = TargetSettings(capacity=((1.0, 2.0, 0.2),))
    assert from_json(TargetSettings, json.loads(json.dumps(t.to_json()))) == t
    for bad in ({"mode": "clever"}, {"attempts": 0}, {"timeout": -1}, {"nonsense": 1}, [1]):
        with pytest.raises(ValueError):
            from_json(LayerSettings, bad)
    with pytest.raises(ValueError):
        from_json(TargetSettings, {"capacity": [[1, 2, 0]]})


def test_naive_backoff_is_full_jitter_capped() -> None:
    rng = random.Random(1)
    for retry in range(1, 10):
        for _ in range(100):
            assert 0 <= naive.backoff(retry, 0.05, 1.0, rng) <= min(1.0, 0.05 * 2 ** (retry - 1))


async def test_the_worker_pool_is_first_come_first_served_and_cancellable() -> None:
    pool = Pool(1)
    order: list[int] = []

    async def user(i: int, hold: float) -> None:
        await pool.acquire()
        order.append(i)
        await asyncio.sleep(hold)
        pool.release()

    await pool.acquire()
    tasks = [asyncio.create_task(user(i, 0.001)) for i in range(5)]
    await asyncio.sleep(0)
    assert pool.queued() == 5
    tasks[1].cancel()  # leaves the queue without holding a worker
    await asyncio.sleep(0)
    pool.release()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert order == [0, 2, 3, 4]
    assert pool.free == 1 and pool.queued() == 0


def test_goals_are_judged_from_the_rows() -> None:
    def row(scenario: str, policy: str, mean: float, mx: int, success: float = 0.0, recovery: float | None = None,
            after: float | None = None) -> dict[str, Any]:
        return {"scenario": scenario, "policy": policy, "questions": 1000, "success_rate": success,
                "arrivals_per_question": {"mean": mean, "p99": mx, "max": mx}, "recovery_s": recovery,
                "arrivals_per_question_after_protected": None if after is None else {"mean": after},
                "horizon_s": 6, "budget": 3}

    rows = [row("outage", "naive", 27.0, 27), row("outage", "askonce", 0.2, 4, after=0.02),
            row("transient", "askonce", 1.11, 3, success=0.9995),
            row("transient-50", "no-retry", 1, 1, success=0.50),
            row("transient-50", "askonce", 1.2, 4, success=0.496),
            row("overload", "no-retry", 1, 1),
            row("overload", "naive", 1.5, 4),
            {**row("overload", "askonce", 1, 1, recovery=0.0), "cut_goodput": 0.93}]
    assert all(g["met"] for g in measure.goals(rows)), measure.goals(rows)
    rows[1] = row("outage", "askonce", 0.2, 5)  # one question over 1 + budget, and no protection
    rows[2] = row("transient", "askonce", 1.11, 3, success=0.998)
    rows[4] = row("transient-50", "askonce", 1.2, 4, success=0.494)  # under no-retry's, by 0.6
    rows[6] = row("overload", "naive", 1.5, 4, recovery=3.0)
    rows[7] = {**rows[7], "cut_goodput": 0.85}
    assert [g["met"] for g in measure.goals(rows)] == [True, False, False, False, False, False,
                                                       False, True]


def test_the_stuck_goal_holds_askonce_to_one_call_of_work_per_question() -> None:
    def row(policy: str, success: float, work: float, mx: int, questions: int = 24) -> dict[str, Any]:
        return {"scenario": "stuck", "policy": policy, "questions": questions, "success_rate": success,
                "arrivals_per_question": {"mean": 1.0, "p99": mx, "max": mx}, "recovery_s": None,
                "target_work_s": work, "call_s": 3.0, "budget": 3}

    def met(*rows: dict[str, Any]) -> bool | None:
        (goal,) = [g for g in measure.goals(list(rows)) if g["goal"].startswith("stuck")]
        return goal["met"]

    naive = row("naive", 0.0, 24 * 27 * 3.0, 27)
    assert met(naive, row("askonce", 1.0, 24 * 3.0 * 1.04, 1)) is True
    assert met(naive, row("askonce", 1.0, 24 * 3.0 * 1.06, 1)) is False  # the work done twice for some
    assert met(naive, row("askonce", 1.0, 24 * 3.0, 5)) is False  # over 1 + budget arrivals
    assert met(row("naive", 0.5, 24 * 9.0, 3), row("askonce", 0.4, 24 * 3.0, 1)) is False  # fewer answered
    assert met(naive, row("askonce", 0.9, 24 * 3.0, 1)) is False  # more than naive's nothing, not enough
    assert met(naive, {**row("askonce", 1.0, 24 * 3.0, 1), "call_s": None}) is False  # no call time: no verdict


def test_the_sweep_is_the_transient_scenario_at_each_rate() -> None:
    base = params.scenarios()
    swept = params.scenarios(error_rates=(0.5, 0.9), breaker=True)
    assert list(swept) == [*base, "transient-50", "transient-90"]
    for name, rate in (("transient-50", 0.5), ("transient-90", 0.9)):
        s = swept[name]
        assert s.target.rate == rate and s.policies == params.POLICIES and s.breaker
        assert s.target == dataclasses.replace(base["transient"].target, rate=rate)
        assert params.kind(name) == "transient" and params.sweep_name(rate) == name
    with pytest.raises(ValueError, match="error rate"):
        params.scenarios(error_rates=(1.5,))


def test_a_goal_whose_runs_were_starved_is_not_judged() -> None:
    def row(scenario: str, policy: str, lag: float) -> dict[str, Any]:
        return {"scenario": scenario, "policy": policy, "questions": 1000, "success_rate": 0.5,
                "arrivals_per_question": {"mean": 1.0, "p99": 1, "max": 1, "se": 0.001},
                "recovery_s": None, "launch_lag_ms": {"p99": lag, "max": lag}}

    rows = [row("transient", "naive", 5.0), row("transient", "askonce", 487.0),
            row("outage", "naive", 3.0), row("overload", "naive", 900.0),
            row("overload", "askonce", 5.0), row("overload", "no-retry", 5.0)]
    # a collapsed naive stack that did not settle after its run is restarted before the next run:
    # its figures were taken before, so it is judged
    rows[3]["settled"] = False
    assert measure.invalid(rows) == {("transient", "askonce"): [
        "askonce: the load generator launched a question 487 ms late (the machine was too busy "
        "for the load)"]}  # the naive overload's lag is its own retries': the finding itself
    judged = {g["goal"].split(":")[0]: g for g in measure.goals(rows)}
    assert judged["transient 10%"]["met"] is None  # not "NOT met": the run measured the CPU
    assert "not judged, the run is not valid" in judged["transient 10%"]["measured"]
    assert judged["outage"]["met"] is False  # a valid scenario is judged as before
    assert all(g["met"] is not None for g in measure.goals(rows) if g["goal"].startswith("over"))


def test_a_tail_too_slow_for_its_calibrated_slow_calls_is_not_judged() -> None:
    def row(policy: str, p99: float, median: float, slow: float) -> dict[str, Any]:
        return {"scenario": "tail", "policy": policy, "questions": 1000, "success_rate": 1.0,
                "arrivals_per_question": {"mean": 1.01, "p99": 2, "max": 2, "se": 0.001},
                "latency_ms": {"p50": median, "p99": p99}, "recovery_s": None,
                "launch_lag_ms": {"p99": 5.0, "max": 5.0},
                "slow_s": slow, "slow_factor": 20.0, "calibrated_median_ms": median}

    fits = [row("naive", 1400.0, 70.0, 1.4), row("askonce", 250.0, 70.0, 1.4)]
    assert measure.invalid(fits) == {}
    (goal,) = measure.goals(fits)
    assert goal["met"] is True  # 250 ms against a fifth of 1,400
    # a median of 300 ms would need 6 s slow calls; capped at 4 s they are a milder tail
    capped = [row("naive", 4100.0, 300.0, 4.0), row("askonce", 900.0, 300.0, 4.0)]
    assert measure.invalid(capped)[("tail", "askonce")] == [
        "the stack answered its fast calls in a median of 300 ms, too slow for slow calls of 20x "
        "that within the deadline"]
    (goal,) = measure.goals(capped)
    assert goal["met"] is None and "not judged" in goal["measured"]


# --- the real thing ---------------------------------------------------------------------------------


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # a zombie is dead, just not reaped
    except FileNotFoundError:
        return True


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                pass
    return out


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if not _gone(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if not _gone(p)]


def test_quick_demo_prints_the_schema_and_the_headline_figures(tmp_path: Path) -> None:
    done = subprocess.run([*DEMO, "--quick", "--json", "--out", str(tmp_path / "report")], capture_output=True,
                          timeout=180, text=True)  # about 35 s; a loaded machine takes longer
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(done.stdout)  # stdout holds the JSON and nothing else
    rows = {(r["scenario"], r["policy"]): r for r in doc["scenarios"]}
    stuck = {("stuck", p) for p in ("no-retry", "naive", "askonce")}
    assert set(rows) == ({(s, p) for s in ("outage", "transient", "slow", "tail") for p in ("naive", "askonce")}
                         | {("overload", p) for p in ("no-retry", "naive", "askonce")} | stuck)
    for r in doc["scenarios"]:
        assert isinstance(r["questions"], int) and r["questions"] > 0
        assert set(r["arrivals_per_question"]) >= {"mean", "p99", "max"}
        assert set(r["latency_ms"]) >= {"p50", "p99"}
        assert r["coverage"] is None or 0 <= r["coverage"] <= 1
        assert 0 <= r["success_rate"] <= 1
        assert r["recovery_s"] is None or (r["scenario"] == "overload" and r["recovery_s"] >= 0)
    assert rows["outage", "naive"]["arrivals_per_question"]["mean"] >= 20
    outage = rows["outage", "askonce"]
    assert outage["arrivals_per_question"]["max"] <= 1 + outage["budget"]
    # The service's admission cuts the dead target off after its first 20 attempts.
    assert outage["target_arrivals"] <= 20 + outage["budget"] + outage["questions"] // 10
    if ("transient", "askonce") not in measure.invalid(doc["scenarios"]):  # a starved run measures the CPU
        assert rows["transient", "askonce"]["success_rate"] >= 0.99  # 0.999 needs more questions
    assert rows["transient", "askonce"]["coverage"] == 1.0
    # the tail's slow calls were calibrated once, to 20x the median of a run of fast calls
    tails = [rows["tail", p] for p in ("naive", "askonce")]
    median = tails[0]["calibrated_median_ms"]
    assert median is not None and median >= 1000 * doc["parameters"]["tail"]["target"]["service_time"]
    assert all(t["calibrated_median_ms"] == median for t in tails)
    slow = min(runner.MAX_SLOW, 20 * median / 1000)
    assert all(t["slow_s"] == pytest.approx(slow) for t in tails)
    assert doc["parameters"]["tail"]["target"]["slow_time"] == pytest.approx(slow)  # as it was run
    # Answers in the capacity cut over what it allows (16 a second in the quick run's 2 s).
    assert all(0 <= rows["overload", p]["cut_goodput"] <= 1.5 for p in ("no-retry", "naive", "askonce"))
    assert (tmp_path / "report" / "index.html").exists() and (tmp_path / "report" / "arrivals.png").exists()
    assert json.loads((tmp_path / "report" / "results.json").read_text())["scenarios"] == doc["scenarios"]
    assert len(doc["pids"]) >= 4  # the one stack of four processes (more if one was restarted)
    assert _wait_gone(doc["pids"], 5.0) == [], "the demo left processes behind"


def test_with_redis_the_buckets_breakers_and_ledger_live_in_redis(tmp_path: Path, shared_redis: RedisServer) -> None:
    import redis

    done = subprocess.run([*DEMO, "--quick", "--json", "--scenarios", "outage", "--redis", shared_redis.url,
                           "--breaker", "--out", str(tmp_path)], capture_output=True, timeout=60, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["policy"]: r for r in json.loads(done.stdout)["scenarios"]}
    assert rows["askonce"]["arrivals_per_question"]["max"] <= 3  # the breaker opens on the third failure
    assert rows["askonce"]["ledger"]["coverage"] == 1.0  # the Redis ledger's own report
    assert rows["askonce"]["ledger"]["arrivals"] == rows["askonce"]["target_arrivals"]
    client = redis.Redis.from_url(shared_redis.url)
    keys = [k.decode() for k in client.scan_iter("{askonce-demo:*")]
    client.close()
    assert any(":breaker:" in k and ":service:" in k for k in keys), keys[:20]  # the service's breaker
    assert any(":ledger:" in k or k.endswith(":meta") for k in keys), keys[:20]  # the target's ledger


def test_a_redis_that_cannot_be_reached_is_a_clear_error(tmp_path: Path) -> None:
    done = subprocess.run([*DEMO, "--quick", "--redis", "redis://127.0.0.1:1/0", "--out", str(tmp_path)],
                          capture_output=True, timeout=30, text=True)
    assert done.returncode == 2
    assert "cannot reach Redis at redis://127.0.0.1:1/0" in done.stderr


def _start_demo(tmp_path: Path) -> tuple[subprocess.Popen[bytes], list[int]]:
    demo = subprocess.Popen([*DEMO, "--quick", "--scenarios", "overload", "--out", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    children: list[int] = []
    while len(children) < 4 and time.monotonic() < deadline:  # the four processes of its stack
        time.sleep(0.2)
        children = _children(demo.pid)
    if len(children) < 4:
        _reap([demo.pid, *children])
        pytest.fail("the demo did not start its stack")
    time.sleep(1.0)  # let it get going
    return demo, children


def _reap(pids: list[int]) -> None:
    """Kill what a failed test left behind, so that one failure does not leave processes running."""
    for pid in pids:
        if not _gone(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_demo_stops_every_process_it_started(tmp_path: Path, how: signal.Signals) -> None:
    demo, children = _start_demo(tmp_path)
    try:
        demo.send_signal(how)
        assert demo.wait(15) != 0
        assert _wait_gone(children, 5.0) == []
    finally:
        _reap([demo.pid, *children])


def test_a_killed_demo_leaves_no_orphans(tmp_path: Path) -> None:
    demo, children = _start_demo(tmp_path)
    try:
        demo.kill()  # no clean-up code runs: the children must notice on their own (stdin closes)
        demo.wait(5)
        assert _wait_gone(children, 5.0) == []
    finally:
        _reap(children)


def test_cli_defaults_agree_with_the_demo_parameters() -> None:
    # cli.py repeats two values so that `askonce --help` imports no demo module; they must not drift.
    from askonce.demo import cli, params

    assert cli.DEMO_BUDGET == params.DEMO_BUDGET
    assert cli.SCENARIOS == params.SCENARIOS


def test_the_grace_reaches_every_scenario_and_absurd_values_are_refused() -> None:
    from askonce.demo.cli import _grace

    assert {s.grace for s in scenarios(grace=0.1).values()} == {0.1}
    assert {s.grace for s in scenarios().values()} == {0.0}
    for bad in ("nan", "-1", "11", "soon"):
        with pytest.raises(argparse.ArgumentTypeError):
            _grace(bad)
    with pytest.raises(ValueError, match="grace"):
        scenarios(grace=float("nan"))
    with pytest.raises(ValueError, match="grace"):
        LayerSettings(grace=-0.5)


@pytest.mark.parametrize("questions", ["0", "-3", "many"])
def test_in_process_questions_below_one_are_a_usage_error(questions: str) -> None:
    done = run_cli(["demo", "--in-process", "--questions", questions])
    one_line_error(done, 2, "--questions", "at least 1")


@pytest.mark.parametrize("rates", ["0.5,1.5", "nan", "half", "0.1,"])
def test_error_rates_outside_zero_to_one_are_a_usage_error(rates: str) -> None:
    one_line_error(run_cli(["demo", "--error-rates", rates]), 2, "--error-rates", "within 0..1")


@pytest.mark.parametrize("flags", [["--questions", "5"], ["--depth", "2"]])
def test_in_process_flags_without_in_process_are_refused(flags: list[str]) -> None:
    one_line_error(run_cli(["demo", *flags]), 2, flags[0], "only applies with --in-process")


def test_in_process_flags_have_help() -> None:
    out = run_cli(["demo", "--help"]).stdout
    assert "at least 1" in out and "retrying layers" in out and "refused without it" in out


@pytest.mark.parametrize("where", ["/proc/nope", "a-file"])
def test_an_out_folder_that_cannot_be_written_is_refused_before_the_stack_starts(
        where: str, tmp_path: Path) -> None:
    if where == "a-file":
        where = str(tmp_path / "a-file")
        Path(where).write_text("")
    one_line_error(run_cli(["demo", "--quick", "--out", where], timeout=10), 2, "--out", where)


def test_a_missing_rich_names_the_extra(tmp_path: Path) -> None:
    done = run_cli(["demo", "--quick", "--out", str(tmp_path)], block=("rich",), timeout=10)
    one_line_error(done, 2, "rich", "pip install 'askonce[demo]'")
