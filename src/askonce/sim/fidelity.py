"""Fidelity: the simulator run with the demo's own parameters, set beside what the demo measured.

``askonce demo --json`` prints the parameters of every scenario it ran (``parameters``, ``seed``).
:func:`predict_demo` turns that document into simulator runs and returns rows in the demo's
schema; :func:`compare` sets the two side by side (``python -m askonce.sim.fidelity results.json``).
No number of the demo is copied: scenarios are rebuilt with :mod:`askonce.demo.params`, the layers'
tries and backoff are ``LayerSettings``' defaults, the edge's ``EdgePlan``'s, the admission the
library's default (and the breaker ``DEMO_BREAKER`` with ``--breaker``).

The model (:class:`DemoSim`: the simulator's own code, given the demo's inputs and topology):

* the edge (``edge_attempts`` tries of ``edge_timeout``, cut to the deadline) mints the question;
  three layers (gateway, api, service) make 3 tries of ``layer_timeout``; askonce: adaptive
  admission on the service (and the breaker with ``--breaker``), no buckets (the library's default),
  the target shedding past the deadline, and every layer cut at its question's deadline with no
  verdict (the middleware cancels the handler, and the client releases the breaker and tells the
  admission nothing rather than record a failure);
* the api is waitress: ``THREADS`` threads, requests beyond them wait in a FIFO queue (in the
  overload it is what keeps a naive stack's retries away from the target);
* the load: the very launch times and keys of the demo's edge (``poisson_schedule``,
  ``question_keys``);
* the target: ``slots`` workers, ``service_time`` (or ``slow_time``) divided by the capacity
  factor; a failure takes no time. ``draws="replay"``: which arrival fails or is slow is the demo's
  own ``draw(seed, ..., key, n)``; ``"independent"``: the simulator's own seeded draws at the same
  rates, pooled over many runs (what to *expect* of the demo's questions, not a replay of its
  dice).

Left out: CPU. A hop costs ``latency`` each way and nothing else, so latencies are reported, not
predicted, and a stack starved of CPU (``--quick`` runs two stacks at once) is not modelled.
Results, tolerance: ``docs/results.md``, "Fidelity: the simulator against the demo".
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import sys
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from askonce._loop import Tried
from askonce.core.admission import AdmissionPolicy
from askonce.core.backoff import Backoff
from askonce.core.concurrency import ConcurrencyPolicy
from askonce.core.hedge import HedgePolicy
from askonce.core.question import Account, Tab
from askonce.core.retry import LOST, Failure
from askonce.core.wire import MAX_BUDGET, Reply
from askonce.demo import params as demo_params
from askonce.demo.params import Scenario
from askonce.sim.model import Asked, Call, Layer, Sim
from askonce.sim.scenarios import Knobs, percentile, preset
from askonce.sim.world import Policy, Stats, World

HOP_LATENCY = 0.002  # seconds one way per hop, fitted to the demo's refused questions
TOLERANCE = 0.05
# Scenarios whose target's work per question is predicted too (every call takes the same time).
WORK_SCENARIOS = ("stuck",)
# Independent draws: questions simulated per figure, and the most runs.
POOLED, MAX_REPEATS = 20_000, 200
Draws = Literal["replay", "independent"]
# The simulator names its hops layer1..layer4: edge, gateway, api, service.
FIRST, API = "layer1", "layer3"


def scenario_from_json(data: Mapping[str, Any]) -> Scenario:
    """A :class:`Scenario` from one entry of the demo's ``parameters`` (``dataclasses.asdict`` of
    it)."""
    if not isinstance(data, Mapping):
        raise ValueError(f"a scenario's parameters must be a JSON object, "
                         f"got {type(data).__name__}")
    unknown = set(data) - {f.name for f in dataclasses.fields(Scenario)}
    if unknown:
        raise ValueError(f"scenario parameters: unknown keys {sorted(unknown)}")
    values = dict(data)
    try:
        values["target"] = demo_params.from_json(demo_params.TargetSettings, data["target"])
        if data.get("trigger") is not None:
            values["trigger"] = demo_params.Trigger(**data["trigger"])
        values["policies"] = tuple(data.get("policies", ("naive", "askonce")))
        return Scenario(**values)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"scenario parameters: {exc!r}") from None


def policy_for(scenario: Scenario, policy: str) -> Policy:
    """The simulator's preset for one of the demo's policies, with the demo's knobs (one process
    each: ``shared``; the library's adaptive admission on the layer nearest the target, and the
    demo's breaker there too with ``--breaker``). The layers above have admission too in the demo;
    the model leaves it out: what reaches them from below is an answer or a do-not-retry, which is
    no verdict on the target."""
    if policy not in ("no-retry", "naive", "askonce"):
        raise ValueError(f"policy must be one of no-retry, naive, askonce, got {policy!r}")
    layer = demo_params.LayerSettings()
    attempts = demo_params.layer_attempts(policy, scenario.budget)
    chosen = preset(policy, Knobs(attempts=attempts, budget=scenario.budget,
                                  breaker=demo_params.DEMO_BREAKER, admission=AdmissionPolicy(),
                                  askonce_breaker=scenario.breaker,
                                  backoff=Backoff(layer.backoff_base,
                                                  max(layer.backoff_cap, layer.backoff_base)),
                                  shared=True, join=scenario.join,
                                  respond_async=scenario.respond_async))  # fmt: skip
    if not chosen.propagate:
        return chosen
    # The demo's target keeps a concurrency limit only where its settings say so; its edge
    # rejoins a gateway that joins (ClientPolicy.rejoin, the default).
    return dataclasses.replace(chosen, grace=scenario.grace, edge_rejoins=scenario.join,
                               concurrency=(ConcurrencyPolicy() if scenario.target.concurrency
                                            else None),
                               hedge=HedgePolicy() if scenario.hedge else None)


def world_for(scenario: Scenario, *, latency: float = HOP_LATENCY) -> World:
    """The edge and three layers before the demo's target. A trigger scenario stops at the end of
    its load, as the demo's edge does; the others run until every orphaned retry is done, as the
    demo waits for quiet."""
    t, trigger = scenario.target, scenario.trigger
    return World(
        depth=4, clients=1, rate=scenario.rate, duration=scenario.duration,
        deadline=scenario.deadline, timeout=scenario.layer_timeout, latency=latency,
        service=t.service_time, servers=t.slots,
        cut=None if trigger is None else (trigger.start, trigger.end, trigger.factor),
        horizon=None if trigger is None else scenario.duration, settle=0.0,
        bin=1.0 if trigger is None else 0.1,
    )  # fmt: skip


class _Cut(Exception):
    """An attempt the middleware cancelled at the question's deadline."""


class _AllStats(Stats):
    """The simulator's counts plus every question's outcome (the demo's latencies cover failures
    too)."""

    def __init__(self, world: World) -> None:
        super().__init__(world)
        self.outcomes: list[tuple[float, float, bool]] = []  # (born, answered, answered 200)

    def answer(self, q: Any, ok: bool, now: float) -> None:
        super().answer(q, ok, now)
        self.outcomes.append((q.born, now, ok))


class DemoSim(Sim):
    """:class:`Sim` with the demo's inputs. Each override adds to the simulator's own step and
    calls it: the load (``run``, ``on_issue``), the edge (``_build``, ``_send``), the deadline cut
    (``_on_cut``), the api's threads (``on_arrive``, ``_finish``) and the target's draws
    (``_target_arrive``, ``_start``)."""

    def __init__(self, scenario: Scenario, policy: str, *, seed: int, draws: Draws = "replay",
                 latency: float = HOP_LATENCY, sim_seed: int = 1) -> None:
        from askonce.demo.edge import EdgePlan
        from askonce.demo.layer_wsgi import THREADS

        if draws not in ("replay", "independent"):
            raise ValueError(f"draws must be 'replay' or 'independent', got {draws!r}")
        self.scenario, self.draws = scenario, draws
        self.schedule = schedule(scenario, seed)
        self.keys = demo_params.question_keys(len(self.schedule), seed, scenario.name)
        self.plan = EdgePlan(url="", policy=policy, keys=self.keys, schedule=self.schedule,
                             deadline=scenario.deadline,
                             attempts=1 if policy == "no-retry" else scenario.edge_attempts,
                             timeout=scenario.edge_timeout)  # fmt: skip
        world = world_for(scenario, latency=latency)
        self._plain, self._instant = world, dataclasses.replace(world, service=0.0)
        self._slow = dataclasses.replace(world, service=scenario.target.slow_time)
        # id(job) -> (fails, slow) until a worker takes it.
        self._drawn: dict[int, tuple[bool, bool]] = {}
        self._failing = False  # the arrival being started fails (read by the simulator's target)
        self._threads, self._busy_threads, self._draining = THREADS, 0, False
        self._waiting: deque[Call] = deque()  # requests waiting for one of the api's threads
        super().__init__(world, policy_for(scenario, policy), sim_seed,
                         failures=lambda now: self._failing)
        self.stats = self.all = _AllStats(world)

    def _build(self) -> list[Layer]:
        layers = super()._build()
        p = self.plan
        layers[0].retry = dataclasses.replace(layers[0].retry, attempts=p.attempts,
                                              backoff=Backoff(p.backoff_base,
                                                              max(p.backoff_cap, p.backoff_base)))
        return layers

    def run(self) -> Stats:
        if self.schedule:
            self.engine.at(self.schedule[0], self._on_issue, 0)
        self.engine.run(math.inf if self.world.horizon is None else self.world.horizon)
        self.queue.extend(self._waiting)  # requests still waiting for a thread: unfinished too
        self._waiting.clear()
        self._close_unfinished()
        return self.stats

    def on_issue(self, n: int) -> None:
        now = self.engine.now
        if n + 1 < len(self.schedule):
            self.engine.at(self.schedule[n + 1], self._on_issue, n + 1)
        key, deadline = self.keys[n], now + self.world.deadline
        self.stats.issued += 1
        # Only the askonce edge forwards a budget and the deadline, but the naive edge too stops
        # at it.
        budget = self.policy.budget if self.policy.propagate else MAX_BUDGET
        tab = Tab(key, "edge", True, Account(budget), deadline)
        self._serve(Call(Asked(key, 0, now, deadline), self.layers[0], None), tab, (), now)

    def _send(self, c: Call, act: Any, now: float) -> None:
        layer, deadline = c.layer, c.tab.deadline
        edge = layer is not None and layer.name == FIRST
        self._timeout = self.world.timeout
        # The edge's own patience, cut to the deadline (the naive loop and the askonce client
        # alike).
        if edge:
            self._timeout = (self.plan.timeout if deadline is None
                             else min(self.plan.timeout, deadline - now))
        super()._send(c, act, now)
        if (self.policy.propagate and not edge and deadline is not None and c.out is not None
                and c.sent == now):
            self.engine.at(max(now, deadline), self._on_cut, c.out)

    def _on_cut(self, child: Call) -> None:
        """An askonce layer's question reached its deadline with an attempt out: the middleware
        cancels the handler (a WSGI handler's call is limited to the deadline and ends then too);
        the client settles what it forwarded as lost and gives the breaker no verdict
        (``release``: a cancelled call says nothing about the callee); the middleware answers 503
        ``dnr`` ``deadline``."""
        c = child.parent
        if c is None or c.out is not child:
            return
        c.out = None
        now = self.engine.now
        with contextlib.suppress(_Cut):  # the loop settles it as lost, frees the breaker's slot
            self._drive(c, Tried(Failure(False, None, LOST), None, error=_Cut(), fatal=True), now)
        self._finish(c, False, Reply(c.tab.left, True, "deadline"), now)

    def on_arrive(self, c: Call) -> None:
        if c.layer is not None and c.layer.name == API:
            if self._busy_threads >= self._threads:
                self._waiting.append(c)
                return
            self._busy_threads += 1
        super().on_arrive(c)

    def _finish(self, c: Call, ok: bool, reply: Reply, now: float) -> None:
        super()._finish(c, ok, reply, now)
        if c.layer is None or c.layer.name != API:
            return
        self._free_thread()

    def _accept(self, c: Call, now: float) -> None:
        """Async mode: a request the api answers 202 for a run in flight frees its thread now (it
        never finishes here); the run itself holds one to its end, as the api's background
        threads, as many as waitress has, are held."""
        super()._accept(c, now)
        if c.layer is not None and c.layer.name == API:
            run = self._runs.get((API, c.asked.key))
            if run is not None and run.call is not c:
                self._free_thread()

    def _free_thread(self) -> None:
        self._busy_threads -= 1
        if self._draining:  # a request taken off the queue below finished at once: the loop goes on
            return
        self._draining = True
        try:
            while self._waiting and self._busy_threads < self._threads:
                self._busy_threads += 1
                # Served now: its deadline counts from now.
                super().on_arrive(self._waiting.popleft())
        finally:
            self._draining = False

    def _draw(self, what: str, key: str, n: int, share: float) -> bool:
        if share <= 0:
            return False
        if self.draws == "replay":
            return demo_params.draw(self.scenario.target.seed, what, key, n) < share
        return self.rng.random() < share

    def _target_arrive(self, job: Call, now: float) -> None:
        # n: as the demo's target counts.
        t, key, n = self.scenario.target, job.asked.key, job.asked.arrivals + 1
        fails = t.failure == "outage" or (t.failure == "transient"
                                          and self._draw("fail", key, n, t.rate))
        self._drawn[id(job)] = (fails, not fails and t.failure == "slow"
                                and self._draw("slow", key, n, t.slow_share))
        super()._target_arrive(job, now)
        if not (self.queue and self.queue[-1] is job):  # started or shed: no draw waits
            self._drawn.pop(id(job), None)

    def _start(self, job: Call, now: float) -> None:
        # The simulator's target reads the service time from its world: this arrival's world, for
        # the call.
        self._failing, slow = self._drawn.pop(id(job), (False, False))
        self.world = self._instant if self._failing else self._slow if slow else self._plain
        try:
            super()._start(job, now)
        finally:
            self.world = self._plain


def schedule(scenario: Scenario, seed: int) -> list[float]:
    # The demo's launch times; imports httpx, so only when asked.
    from askonce.demo.runner import hash_seed

    return demo_params.poisson_schedule(scenario.rate, scenario.duration,
                                        hash_seed(seed, scenario.name))


def simulate(scenario: Scenario, policy: str, *, seed: int = 1, draws: Draws = "replay",
             latency: float = HOP_LATENCY, repeats: int | None = None) -> dict[str, Any]:
    """One demo row as the simulator predicts it, in the demo's ``--json`` schema. ``seed``: the
    demo's ``--seed``. ``repeats``: runs pooled; a replay is one run (the demo's draws are fixed),
    independent draws default to enough runs for about ``POOLED`` questions."""
    if repeats is None:
        repeats = 1 if draws == "replay" else min(
            MAX_REPEATS, math.ceil(POOLED / max(1, len(schedule(scenario, seed)))))
    if (type(repeats) is not int or not 1 <= repeats <= MAX_REPEATS
            or (draws == "replay" and repeats != 1)):
        raise ValueError(f"repeats must be 1 for a replay, within 1..{MAX_REPEATS} otherwise, "
                         f"got {repeats!r}")
    hist: dict[int, int] = {}
    latencies: dict[int, int] = {}  # whole milliseconds -> questions answered, failures too
    issued = ok = arrivals = answered = attributable = counted = polls = 0
    work = 0.0
    recovery = None
    for i in range(repeats):
        sim = DemoSim(scenario, policy, seed=seed, draws=draws, latency=latency, sim_seed=i + 1)
        st = sim.run()
        for k, v in st.hist.items():
            hist[k] = hist.get(k, 0) + v
        for born, ended, _ in sim.all.outcomes:
            latencies[int(1000 * (ended - born))] = (
                latencies.get(int(1000 * (ended - born)), 0) + 1)
        issued, ok, arrivals, answered = (issued + st.issued, ok + st.ok, arrivals + st.arrivals,
                                          answered + st.answered)
        work, polls = work + st.busy, polls + st.polls
        totals = sim.ledger.report(sim.engine.now).totals()
        attributable, counted = attributable + totals.attributable, counted + totals.arrivals
        recovery = _recovery(scenario, sim) if repeats == 1 else None
    n = sum(hist.values())
    return {
        "scenario": scenario.name, "policy": policy, "questions": issued // repeats,
        "arrivals_per_question": {"mean": sum(k * v for k, v in hist.items()) / n if n else None,
                                  "p99": percentile(hist, 0.99),
                                  "max": max(hist) if hist else None},
        "coverage": attributable / counted if policy == "askonce" and counted else None,
        "success_rate": ok / issued if issued else None,
        "latency_ms": {"p50": percentile(latencies, 0.5), "p99": percentile(latencies, 0.99)},
        "recovery_s": recovery, "target_arrivals": arrivals / repeats,
        "target_work_s": work / repeats, "polls": polls / repeats,
        "unanswered": (issued - answered) / repeats,
        "simulated": {"draws": draws, "repeats": repeats, "hop_latency_s": latency},
    }  # fmt: skip


def _recovery(scenario: Scenario, sim: DemoSim) -> float | None:
    """The demo's own ``measure.recovery_time`` over the simulated questions."""
    trigger = scenario.trigger
    if trigger is None:
        return None
    from askonce.demo import measure
    from askonce.demo.edge import Asked as EdgeAsked

    outcomes = {born: (ended, ok) for born, ended, ok in sim.all.outcomes}
    asked = []
    for key, t in zip(sim.keys, sim.schedule, strict=True):
        a = EdgeAsked(key, t, launched=t)
        if t in outcomes:
            a.ended, ok = outcomes[t]
            a.status = 200 if ok else 503
        asked.append(a)
    return measure.recovery_time(asked, scenario.deadline,
                                 baseline=(min(1.0, trigger.start / 2), trigger.start),
                                 trigger_end=trigger.end, horizon=scenario.duration,
                                 window=scenario.window)


def predict_demo(demo_json: Mapping[str, Any], *, draws: Draws = "replay",
                 latency: float = HOP_LATENCY, repeats: int | None = None) -> dict[str, Any]:
    """The simulator's prediction of every row of an ``askonce demo --json`` document, in the
    demo's schema: ``{"scenarios": [row, ...], "model": {...}}``, rows in the demo's order with its
    keys plus ``target_arrivals``, ``unanswered``, ``simulated``. ``ValueError`` for a document
    without the demo's ``parameters`` or with a scenario or policy the model does not know."""
    if not isinstance(demo_json, Mapping):
        raise ValueError(f"expected the demo's JSON document (an object), "
                         f"got {type(demo_json).__name__}")
    params, seed, rows = (demo_json.get("parameters"), demo_json.get("seed", 1),
                          demo_json.get("scenarios"))
    if not isinstance(params, Mapping) or not params:
        raise ValueError("the demo's JSON has no 'parameters' "
                         "(made by 'askonce demo --json' of this askonce?)")
    if type(seed) is not int:
        raise ValueError(f"the demo's seed must be an integer, got {seed!r}")
    scenarios = {name: scenario_from_json(p) for name, p in params.items()}
    if not isinstance(rows, list) or not all(isinstance(r, Mapping) for r in rows):
        raise ValueError("the demo's JSON has no list of 'scenarios' rows")
    out = []
    for r in rows:
        name, policy = r.get("scenario"), r.get("policy")
        if name not in scenarios:
            raise ValueError(f"row {name}/{policy}: no parameters for scenario {name!r}")
        out.append(simulate(scenarios[name], str(policy), seed=seed, draws=draws, latency=latency,
                            repeats=repeats))
    return {"scenarios": out, "model": {"draws": draws, "hop_latency_s": latency, "seed": seed}}


def within(sim: float | None, demo: float | None, questions: int,
           tolerance: float = TOLERANCE) -> bool:
    """A figure per question agrees: ``|sim - demo| <= max(tolerance * demo, 1 / questions)``.

    ``1 / questions`` is one arrival (or question) in the demo's whole run: no single run can be
    matched more finely. It decides only where one step is worth more than the tolerance (a run
    with few questions, where whether two calls overlap moves the figure by a whole arrival).
    """
    if sim is None or demo is None:
        return sim is None and demo is None
    return abs(sim - demo) <= max(tolerance * abs(demo), 1 / max(1, questions)) + 1e-12


def success_within(sim: float | None, demo: float | None, questions: int,
                   tolerance: float = TOLERANCE) -> bool:
    """Success rates agree when the success rates *and* the failure rates do (:func:`within`):
    near 1, 5 % of the success rate alone would let five points of failures pass."""
    if sim is None or demo is None:
        return sim is None and demo is None
    return (within(sim, demo, questions, tolerance)
            and within(1 - sim, 1 - demo, questions, tolerance))


def compare(demo_json: Mapping[str, Any], predicted: Mapping[str, Any],
            tolerance: float = TOLERANCE) -> list[dict[str, Any]]:
    """Demo against simulator, row by row: both figures, the relative difference, and whether they
    agree."""
    demo_rows = {(r["scenario"], r["policy"]): r for r in demo_json.get("scenarios", [])}
    out = []
    for p in predicted["scenarios"]:
        d = demo_rows.get((p["scenario"], p["policy"]))
        if d is not None:
            n, dm, pm = (int(d["questions"]), d["arrivals_per_question"]["mean"],
                         p["arrivals_per_question"]["mean"])
            ds, ps = d["success_rate"], p["success_rate"]
            dw, pw = (None if r.get("target_work_s") is None or not n
                      else r["target_work_s"] / n for r in (d, p))
            out.append({
                "scenario": p["scenario"], "policy": p["policy"], "questions": n,
                "arrivals_mean": (dm, pm), "arrivals_error": _rel(pm, dm),
                "arrivals_ok": within(pm, dm, n, tolerance),
                "success_rate": (ds, ps), "success_error": _rel(ps, ds),
                "success_ok": success_within(ps, ds, n, tolerance),
                "work_per_question": (dw, pw), "work_error": _rel(pw, dw),
                "work_ok": _work_within(pw, dw, tolerance),
                "work_checked": p["scenario"] in WORK_SCENARIOS,
            })  # fmt: skip
    return out


def agrees(row: Mapping[str, Any]) -> bool:
    """A :func:`compare` row agrees: arrivals and success, and the work where it is predicted."""
    return bool(row["arrivals_ok"] and row["success_ok"]
                and (row["work_ok"] or not row.get("work_checked")))


def _work_within(sim: float | None, demo: float | None, tolerance: float) -> bool:
    """The target's seconds of work per question agree to ``tolerance`` of the demo's (a second
    of work has no step the size of one arrival: the tolerance alone decides)."""
    if sim is None or demo is None:
        return sim is None and demo is None
    return abs(sim - demo) <= tolerance * abs(demo) + 1e-9


def _rel(sim: float | None, demo: float | None) -> float | None:
    if sim is None or demo is None:
        return None
    return (sim - demo) / demo if demo else 0.0 if sim == 0 else math.inf


def table(rows: Sequence[Mapping[str, Any]]) -> str:
    """:func:`compare`'s rows as a plain-text table."""
    def f(x: float | None, spec: str) -> str:
        return "-" if x is None else "inf" if math.isinf(x) else format(x, spec)

    lines = [f"{'scenario':<10} {'policy':<9} {'questions':>9} {'A demo':>8} {'A sim':>8}"
             f" {'diff':>7} {'success demo':>12} {'success sim':>11} {'diff':>7}  agree"
             f"  {'work/q demo':>11} {'work/q sim':>10} {'diff':>7}"]
    for r in rows:
        (dm, pm), (ds, ps) = r["arrivals_mean"], r["success_rate"]
        dw, pw = r.get("work_per_question", (None, None))
        lines.append(f"{r['scenario']:<10} {r['policy']:<9} {r['questions']:>9}"
                     f" {f(dm, '.3f'):>8} {f(pm, '.3f'):>8}"
                     f" {f(r['arrivals_error'], '+.1%'):>7} {f(ds, '.2%'):>12} {f(ps, '.2%'):>11}"
                     f" {f(r['success_error'], '+.1%'):>7}"
                     f"  {'yes' if agrees(r) else 'NO'}"
                     f"  {f(dw, '.3f'):>11} {f(pw, '.3f'):>10} {f(r.get('work_error'), '+.1%'):>7}")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m askonce.sim.fidelity RESULTS.json``: the demo's figures against the
    simulator's."""
    parser = argparse.ArgumentParser(prog="python -m askonce.sim.fidelity",
                                     description=main.__doc__)
    parser.add_argument("results",
                        help="the output of 'askonce demo --json' (or a report's results.json)")
    parser.add_argument("--draws", choices=("replay", "independent"), default="replay")
    parser.add_argument("--json", action="store_true",
                        help="print the predictions in the demo's schema")
    args = parser.parse_args(argv)
    try:
        with open(args.results, encoding="utf-8") as fh:
            doc = json.load(fh)
        predicted = predict_demo(doc, draws=args.draws)
        out = (json.dumps(predicted, indent=2) + "\n" if args.json
               else table(compare(doc, predicted)))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"askonce fidelity: {exc}", file=sys.stderr)
        return 2
    print(out, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
