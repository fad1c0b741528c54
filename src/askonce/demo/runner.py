"""Runs the scenarios on a started :class:`~askonce.demo.stack.Stack`: configure, load, count,
settle.

For each scenario and policy: every process is configured for the run (which also resets its
counts, clients, buckets, breakers and ledger), the edge asks its questions, the target's counts
are fetched, and the stack is drained until nothing is in flight before the next run starts.
"""

from __future__ import annotations

import asyncio
import time
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from askonce.demo import edge, measure
from askonce.demo.params import (
    LayerSettings,
    Scenario,
    layer_attempts,
    poisson_schedule,
    question_keys,
)
from askonce.demo.stack import CHAIN, Stack

LEAD = 0.1  # seconds between configuring a run and its first question
SETTLE_TIMEOUT = 2.0  # seconds to wait for the stack to go quiet between runs; then it is restarted
SETTLE_POLL = 0.15
# Seconds to wait, after the last answer, for work and retries nobody waits for any more.
QUIET_TIMEOUT = 4.0
# A scenario's calibration (Scenario.slow_factor): this long a run of fast calls only, and its
# slow arrivals take at most MAX_SLOW seconds (within the tail's 5 s deadline).
CALIBRATION_S = 2.0
MAX_SLOW = 4.0


@dataclass
class Run:
    """One scenario under one policy: the row of the report and the series behind its plots."""

    row: dict[str, Any]
    # (seconds, arrivals per second)
    timeline: list[tuple[float, int]] = field(default_factory=list)
    goodput: list[int] = field(default_factory=list)  # successes per second (overload)


Tick = Callable[[str, int, int], None]  # (run label, questions finished, questions in all)


class Runner:
    def __init__(self, stack: Stack, *, seed: int = 1, redis: str | None = None,
                 tick: Tick | None = None) -> None:
        self.stack = stack
        self._slow: dict[str, tuple[float, float | None]] = {}  # scenario: (slow_time, median s)
        self.seed = seed
        self.redis = redis
        self.tick = tick
        self.run_id = uuid.uuid4().hex[:8]

    def prefix(self, scenario: Scenario, policy: str) -> str:
        """Where this run's shared state lives in Redis: nothing carries over from another run."""
        return f"askonce-demo:{self.run_id}:{scenario.name}:{policy}"

    def layer_settings(self, scenario: Scenario, policy: str) -> dict[str, LayerSettings]:
        out = {}
        for i, name in enumerate(CHAIN[:-1]):
            out[name] = LayerSettings(
                mode="askonce" if policy == "askonce" else "naive",
                downstream=self.stack.url(CHAIN[i + 1]),
                attempts=layer_attempts(policy, scenario.budget),
                timeout=scenario.layer_timeout, grace=scenario.grace, join=scenario.join,
                # The layer nearest the target; every askonce layer has adaptive admission.
                breaker=scenario.breaker and policy == "askonce" and name == "service",
                hedge=scenario.hedge and policy == "askonce" and name == "service",
                respond_async=scenario.respond_async and policy == "askonce",
                seed=self.seed, redis=self.redis, prefix=self.prefix(scenario, policy),
            )  # fmt: skip
        return out

    async def run(self, scenario: Scenario, policy: str, *, settle: bool = True) -> Run:
        """Configure every process for ``policy``, ask the scenario's questions, count, and settle.

        ``settle=False`` for the last run of a stack: nothing follows that could inherit its load.
        """
        loop = asyncio.get_running_loop()
        scenario, median = await self.calibrated(scenario)  # before: not this run's own time
        entered = loop.time()
        schedule = poisson_schedule(scenario.rate, scenario.duration,
                                    hash_seed(self.seed, scenario.name))
        keys = question_keys(len(schedule), self.seed, scenario.name)
        trigger = scenario.trigger
        prefix = self.prefix(scenario, policy)
        plan = edge.EdgePlan(
            url=self.stack.url("gateway") + "/q", policy=policy, keys=keys, schedule=schedule,
            deadline=scenario.deadline,
            attempts=1 if policy == "no-retry" else scenario.edge_attempts,
            timeout=scenario.edge_timeout, budget=scenario.budget, grace=scenario.grace,
            seed=self.seed, stop_at=scenario.duration if trigger is not None else None,
            store=self._edge_store(prefix, policy),
            respond_async=scenario.respond_async and policy == "askonce",
        )  # fmt: skip
        clients = edge.clients_for(plan)
        label = f"{scenario.name} · {policy}"
        tick = self.tick
        on_tick = None if tick is None else (lambda n: tick(label, n, len(keys)))
        if on_tick is not None:
            on_tick(0)
        async with httpx.AsyncClient(timeout=10.0, trust_env=False) as control:
            posts = [control.post(self.stack.url(n) + "/_demo/config", json=s.to_json())
                     for n, s in self.layer_settings(scenario, policy).items()]
            for response in await asyncio.gather(*posts):
                response.raise_for_status()
            t0 = time.time() + LEAD  # the target's clock for its timeline and the capacity cut
            target = replace(scenario.target, mode="askonce" if policy == "askonce" else "naive",
                             join=scenario.join,
                             t0=t0,
                             capacity=() if trigger is None
                             else ((trigger.start, trigger.end, trigger.factor),),
                             redis=self.redis, prefix=prefix)
            (await control.post(self.stack.url("target") + "/_demo/config",
                                json=target.to_json())).raise_for_status()
            asked = await edge.run(plan, loop.time() + max(0.0, t0 - time.time()), on_tick, clients)
            # Let orphaned retries arrive and running work finish, so that both are counted (a
            # retry sent as the last answer came back may still start a call of the longest work).
            if trigger is None:
                t = scenario.target
                await self.quiet(control, QUIET_TIMEOUT + max(t.service_time, t.slow_time))
            counts = (await control.get(self.stack.url("target") + "/_demo/stats",
                                        params={"full": "1"})).json()
            began = loop.time()
            settled = await self.settle(control) if settle else True
        if not settled:  # a collapsed naive stack can take minutes to unwind: start afresh instead
            await loop.run_in_executor(None, self.stack.restart)
        run = self._result(scenario, policy, asked, counts, settled)
        if scenario.slow_factor is not None:
            run.row["slow_s"] = scenario.target.slow_time
            run.row["slow_factor"] = scenario.slow_factor
            run.row["calibrated_median_ms"] = None if median is None else 1000.0 * median
        run.row["settle_s"] = round(loop.time() - began, 2)
        run.row["run_s"] = round(loop.time() - entered, 2)
        return run

    async def calibrated(self, scenario: Scenario) -> tuple[Scenario, float | None]:
        """``scenario`` with its slow arrivals at ``slow_factor`` times the stack's median answer
        (and that median, in seconds), measured once per scenario by a naive run of fast calls
        only; as it is without a ``slow_factor``, or when the calibration answered nothing."""
        if scenario.slow_factor is None:
            return scenario, None
        if scenario.name not in self._slow:
            t = scenario.target
            probe = replace(scenario, name=f"{scenario.name}-calibration", slow_factor=None,
                            duration=min(CALIBRATION_S, scenario.duration / 2),
                            target=replace(t, slow_share=0.0))
            p50 = (await self.run(probe, "naive")).row["latency_ms"]["p50"]
            median = None if p50 is None else p50 / 1000.0
            slow = t.slow_time if median is None else min(MAX_SLOW, scenario.slow_factor * median)
            self._slow[scenario.name] = (slow, median)
        slow, median = self._slow[scenario.name]
        return replace(scenario, target=replace(scenario.target, slow_time=slow)), median

    def _edge_store(self, prefix: str, policy: str) -> Any:
        if policy != "askonce" or self.redis is None:
            return None
        from askonce.stores.aredis import AsyncRedisStore

        return AsyncRedisStore(self.redis, prefix=f"{prefix}:edge")

    def _result(self, scenario: Scenario, policy: str, asked: list[edge.Asked],
                counts: dict[str, Any], settled: bool) -> Run:
        per_key: dict[str, int] = counts.get("per_key", {})
        row = measure.summarize(scenario.name, policy, asked, per_key, scenario.deadline, counts)
        row["settled"] = settled
        row["budget"] = scenario.budget
        row["grace"] = scenario.grace
        t, trigger = scenario.target, scenario.trigger
        # The work of one call, where every call takes the same (no failures, no slow share).
        row["call_s"] = t.service_time if t.failure == "none" and trigger is None else None
        goodput: list[int] = []
        if trigger is not None:
            row["recovery_s"] = measure.recovery_time(
                asked, scenario.deadline, baseline=(min(1.0, trigger.start / 2), trigger.start),
                trigger_end=trigger.end, horizon=scenario.duration, window=scenario.window)
            row["horizon_s"] = scenario.duration - trigger.end
            # what the cut leaves: slots / service time, times the factor
            row["cut_goodput"] = None if t.service_time <= 0 else measure.cut_goodput(
                asked, scenario.deadline, trigger.start, trigger.end,
                t.slots / t.service_time * trigger.factor)
            goodput = measure.goodput_series(asked, scenario.deadline, scenario.duration)
        per_bin = max(1, round(1 / float(counts.get("bin", 0.1))))  # the target's bins per second
        per_second: dict[int, int] = {}
        for k, v in counts.get("timeline", {}).items():
            second = int(k) // per_bin
            per_second[second] = per_second.get(second, 0) + int(v)
        seconds = range(max((k for k in per_second if k >= 0), default=-1) + 1)
        timeline = [(float(k), per_second.get(k, 0)) for k in seconds]
        row["arrivals_per_s"] = [n for _, n in timeline]
        if goodput:
            row["goodput_per_s"] = goodput
        return Run(row, timeline, goodput)

    async def settle(self, control: httpx.AsyncClient) -> bool:
        """Drain the target and wait until the stack is quiet; False if it is not within
        ``SETTLE_TIMEOUT``."""
        try:
            async with asyncio.timeout(SETTLE_TIMEOUT):
                await control.post(self.stack.url("target") + "/_demo/drain",
                                   timeout=SETTLE_TIMEOUT)
        except (TimeoutError, httpx.HTTPError):
            return False
        return await self.quiet(control, SETTLE_TIMEOUT)

    async def quiet(self, control: httpx.AsyncClient, timeout: float) -> bool:
        """Wait until no layer has a request in flight and no new arrival reaches the target.

        False if that does not happen within ``timeout`` (a layer too busy to answer counts as
        busy).
        """
        try:
            async with asyncio.timeout(timeout):
                last = -1
                while True:
                    stats = await asyncio.gather(
                        *(control.get(self.stack.url(n) + "/_demo/stats", timeout=SETTLE_POLL * 4)
                          for n in CHAIN),
                        return_exceptions=True)
                    busy, arrivals = 0, last
                    for name, s in zip(CHAIN, stats, strict=True):
                        if isinstance(s, BaseException):
                            busy += 1
                            continue
                        body = s.json()
                        busy += int(body.get("inflight", 0))
                        if name == "target":
                            arrivals = int(body.get("arrivals", 0))
                    if busy == 0 and arrivals == last:
                        return True
                    last = arrivals
                    await asyncio.sleep(SETTLE_POLL)
        except TimeoutError:
            return False


def hash_seed(seed: int, name: str) -> int:
    """A per-scenario seed for the load schedule (stable across runs and Python processes)."""
    return zlib.crc32(f"{seed}:{name}".encode())
