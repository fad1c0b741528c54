"""The standard experiments (docs/experiments.md: E1-E3, E5, E6, E8) as sweeps.

Each sweep runs every policy in a :class:`~askonce.sim.model.World` and turns the raw counts into a
:class:`Row` of figures. The policies:

* ``no-retry`` - one attempt per layer;
* ``naive`` - every layer retries on its own (``attempts``, full-jitter backoff), forwarding only
  an id;
* ``bucket`` - naive plus a retry token bucket per layer and per client (10 % of requests plus a
  1/s floor, at most 10 banked: the SRE book's per-client budget with a small floor);
* ``breaker`` - naive plus a circuit breaker per layer and per client (the library's defaults);
* ``askonce`` - the question travels (budget, deadline, path); every layer keeps its attempt limit
  and no per-target bucket (the library's default; ``--bucket-ratio`` gives one); the layer
  nearest the target has the library's default adaptive admission (``core.admission``: it sheds
  attempts only when the target answers under 5 % of them), and no breaker unless
  ``Knobs.askonce_breaker``; the target sheds work past the propagated deadline. Layer 1's
  bucket (if any) and breaker are shared by the whole client fleet (``shared``), as with the
  Redis store; so is the admission controller when layer 1 is the layer
  nearest the target (depth 1).
* ``askonce-hedge`` - askonce, and the layer nearest the target hedges slow first tries
  (``Knobs.hedge``, the library's default ``HedgePolicy``: ``ClientPolicy.hedge``).
* ``askonce-join`` - askonce, and every layer and the target join a repeated question; every
  layer, the client too, re-attaches a timed-out try (``ClientPolicy.rejoin``).
* ``askonce-async`` - askonce-join, and every layer asks ``Prefer: respond-async``: a callee that
  joins answers 202 at once and the layer polls for the answer (``ClientPolicy.respond_async``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from askonce.core.admission import AdmissionPolicy
from askonce.core.backoff import Backoff
from askonce.core.breaker import BreakerPolicy
from askonce.core.bucket import BucketPolicy
from askonce.core.concurrency import ConcurrencyPolicy
from askonce.core.hedge import HedgePolicy
from askonce.sim.model import Sim
from askonce.sim.world import Policy, Stats, World

POLICIES = ("no-retry", "naive", "bucket", "breaker", "askonce")
JITTER_POLICIES = ("no-jitter", "full-jitter")
EXTRA_POLICIES = ("askonce-join", "askonce-async", "askonce-hedge")
BASELINE_BUCKET = BucketPolicy(ratio=0.1, floor=1.0, max_tokens=10.0)
FOREVER = 1e12  # an outage that outlasts any run
# The breaker of the ``breaker`` baseline and of ``--askonce-breaker``: a classic one that opens at
# half of 20 or more of its last 100 calls failing (the library's default before it became a
# near-total-failure breaker; most breaker libraries open at 50 %).
CLASSIC_BREAKER = BreakerPolicy(failure_rate=0.5, minimum_calls=20)


@dataclass(frozen=True, slots=True)
class Knobs:
    """Policy settings shared by every run of a sweep."""

    attempts: int = 3
    budget: int = 2
    bucket: BucketPolicy | None = None  # askonce's per-target bucket: off, the library default
    baseline_bucket: BucketPolicy = BASELINE_BUCKET
    breaker: BreakerPolicy = CLASSIC_BREAKER
    # askonce: adaptive admission on the layer nearest the target (None: off), and whether that
    # layer also has ``breaker`` (the breaker design: with admission=None)
    admission: AdmissionPolicy | None = field(default_factory=AdmissionPolicy)
    askonce_breaker: bool = False
    backoff: Backoff = Backoff()
    shared: bool = True
    grace: float = 0.0  # askonce: ClientPolicy.deadline_grace of every layer
    join: bool = False  # askonce: every layer and the target join (asgi_join, wsgi_join)
    # askonce: the target's adaptive concurrency limit (None: off)
    concurrency: ConcurrencyPolicy | None = field(default_factory=ConcurrencyPolicy)
    # askonce-hedge: the hedging of the layer nearest the target
    hedge: HedgePolicy = field(default_factory=HedgePolicy)
    respond_async: bool = False  # askonce (with join): every layer asks respond-async


def preset(name: str, knobs: Knobs = Knobs()) -> Policy:
    """The named policy (see the module docstring) with the sweep's knobs."""
    k = knobs
    if name == "no-retry":
        return Policy(name, attempts=1, backoff=k.backoff)
    if name in ("naive", "full-jitter"):
        return Policy(name, attempts=k.attempts, backoff=k.backoff)
    if name == "no-jitter":
        return Policy(name, attempts=k.attempts,
                      backoff=dataclasses.replace(k.backoff, jitter=False))
    if name == "bucket":
        return Policy(name, attempts=k.attempts, backoff=k.backoff, bucket=k.baseline_bucket)
    if name == "breaker":
        return Policy(name, attempts=k.attempts, backoff=k.backoff, breaker=k.breaker)
    if name in ("askonce", "askonce-join", "askonce-async", "askonce-hedge"):
        joins = name in ("askonce-join", "askonce-async")
        return Policy(name, attempts=k.attempts, propagate=True, budget=k.budget, backoff=k.backoff,
                      bucket=k.bucket, breaker=k.breaker if k.askonce_breaker else None,
                      breaker_everywhere=False, admission=k.admission, shared=k.shared, shed=True,
                      grace=k.grace, join=k.join or joins, edge_rejoins=joins,
                      concurrency=k.concurrency,
                      hedge=k.hedge if name == "askonce-hedge" else None,
                      respond_async=k.respond_async or name == "askonce-async")
    raise ValueError(f"unknown policy {name!r}; known: "
                     f"{', '.join((*POLICIES, *JITTER_POLICIES[:2], *EXTRA_POLICIES))}")


@dataclass(frozen=True, slots=True)
class Row:
    """The figures of one policy in one world.

    Arrival figures cover the questions that reached the target.
    """

    scenario: str
    policy: str
    params: Mapping[str, Any]
    questions: int
    reached: int
    arrivals: int
    mean: float | None
    p99: int | None
    max: int | None
    steady_mean: float | None  # questions minted after the world's ``settle`` time
    success_rate: float
    latency_p50_ms: int | None
    latency_p99_ms: int | None
    wasted_s: float
    wasted_fraction: float | None
    recovery_s: float | None  # None: not applicable, or never (see ``recovered``)
    recovered: bool | None
    completion_s: float | None
    ledger_amplification: float | None
    ledger_approximate: bool
    unfinished: int
    events: int
    goodput: tuple[float, ...] = ()  # successes per second, for the scenarios that plot it
    # overload: successes during the cut over what the reduced capacity could answer in it
    cut_goodput: float | None = None
    recovery_asked_s: float | None = None  # recovery_s of goodput per question asked (None: never)
    work_s: float = 0.0  # the target's busy seconds
    polls: int = 0  # status polls of async tries (respond_async), at every hop
    poll_max: int = 0  # the most polls of one question
    wall_s: float = field(default=0.0, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario, "policy": self.policy, "params": dict(self.params),
            "questions": self.questions, "reached": self.reached, "arrivals": self.arrivals,
            "arrivals_per_question": {"mean": self.mean, "p99": self.p99, "max": self.max,
                                      "steady_mean": self.steady_mean},
            "success_rate": self.success_rate,
            "latency_ms": {"p50": self.latency_p50_ms, "p99": self.latency_p99_ms},
            "wasted_work": {"seconds": self.wasted_s, "fraction": self.wasted_fraction},
            "recovery_s": self.recovery_s, "recovered": self.recovered,
            "completion_s": self.completion_s,
            "ledger": {"amplification": self.ledger_amplification,
                       "approximate": self.ledger_approximate},
            "unfinished": self.unfinished, "events": self.events,
            "goodput_per_s": list(self.goodput), "cut_goodput": self.cut_goodput,
            "recovery_asked_s": self.recovery_asked_s,
            "work_s": self.work_s, "polls": {"total": self.polls, "max": self.poll_max},
            "wall_s": self.wall_s,
        }  # fmt: skip


def percentile(hist: Mapping[int, int], q: float) -> int | None:
    """Nearest-rank percentile of a histogram ``value -> count``."""
    n = sum(hist.values())
    if not n:
        return None
    rank, seen = math.ceil(q * n), 0
    for value in sorted(hist):
        seen += hist[value]
        if seen >= rank:
            return value
    return max(hist)


def _mean(hist: Mapping[int, int]) -> float | None:
    n = sum(hist.values())
    return sum(k * v for k, v in hist.items()) / n if n else None


def recovery(bins: Sequence[int], bin_s: float, trigger: tuple[float, float], horizon: float,
             window: float = 5.0, warm: float = 5.0, share: float = 0.9,
             asked: Sequence[int] | None = None) -> float | None:
    """Seconds after the trigger ends until goodput over the next ``window`` seconds is back to
    ``share`` of its mean over ``[warm, trigger start)``; ``None`` if that never happens before
    ``horizon``. ``asked``: questions asked per bin; then goodput is taken per question asked in
    the same seconds (as the demo measures it), so that the load's own noise does not decide."""
    start, end = trigger
    per = round(1 / bin_s)
    lo, hi = round(warm * per), round(start * per)
    if hi <= lo:
        raise ValueError("the trigger must start after the warm-up")
    size = round(horizon * per)
    padded = list(bins) + [0] * max(0, size - len(bins))
    load = [1] * len(padded) if asked is None else list(asked) + [0] * max(0, size - len(asked))
    before = sum(padded[lo:hi]) / max(1, sum(load[lo:hi]))  # successes per bin (per question)
    width = round(window * per)
    first, last = math.ceil(end * per - 1e-9), size - width
    total, n = sum(padded[first:first + width]), sum(load[first:first + width])
    for k in range(first, last + 1):
        if total >= share * before * n:
            return round(k / per - end, 6)
        if k + width < len(padded):
            total += padded[k + width] - padded[k]
        if k + width < len(load):
            n += load[k + width] - load[k]
    return None


def summarise(scenario: str, policy: str, params: Mapping[str, Any], sim: Sim, wall: float,
              trigger: tuple[float, float] | None = None, goodput: bool = False) -> Row:
    st: Stats = sim.stats
    reached = {k: v for k, v in st.hist.items() if k > 0}
    steady = {k: v for k, v in st.steady.items() if k > 0}
    rec = rec_asked = None
    recovered: bool | None = None
    if trigger is not None and sim.world.horizon is not None:
        rec = recovery(st.goodput_bins, st.bin, trigger, sim.world.horizon)
        recovered = rec is not None
        if st.issued_bins:
            rec_asked = recovery(st.goodput_bins, st.bin, trigger, sim.world.horizon,
                                 asked=st.issued_bins)
    per_s = round(1 / st.bin) if st.bin < 1 else 1
    series = tuple(sum(st.goodput_bins[i:i + per_s]) / (per_s * st.bin)
                   for i in range(0, len(st.goodput_bins), per_s))
    totals = sim.ledger.report(sim.engine.now).totals()
    w = sim.world
    cut_goodput = None
    if trigger is not None and w.cut is not None and w.servers is not None and w.service > 0:
        start, end, factor = w.cut
        lo, hi = round(start / st.bin), round(end / st.bin)
        could = min(w.rate, w.servers / w.service * factor) * (end - start)
        cut_goodput = sum(st.goodput_bins[lo:hi]) / could if could > 0 else None
    return Row(
        scenario=scenario, policy=policy, params=dict(params), questions=st.issued,
        reached=sum(reached.values()), arrivals=st.arrivals, mean=_mean(reached),
        p99=percentile(reached, 0.99), max=max(reached) if reached else None,
        steady_mean=_mean(steady), success_rate=st.ok / st.issued if st.issued else 0.0,
        latency_p50_ms=percentile(st.latency_ms, 0.5),
        latency_p99_ms=percentile(st.latency_ms, 0.99),
        wasted_s=round(st.wasted, 6), wasted_fraction=st.wasted / st.busy if st.busy else None,
        recovery_s=rec, recovered=recovered, completion_s=st.last_ok if st.ok else None,
        ledger_amplification=totals.amplification, ledger_approximate=totals.approximate,
        unfinished=st.unfinished, events=sim.engine.events, goodput=series if goodput else (),
        cut_goodput=cut_goodput, recovery_asked_s=rec_asked, work_s=round(st.busy, 6),
        polls=st.polls, poll_max=st.poll_max, wall_s=round(wall, 3),
    )  # fmt: skip


def run_one(scenario: str, name: str, world: World, knobs: Knobs, seed: int,
            params: Mapping[str, Any], trigger: tuple[float, float] | None = None,
            goodput: bool = False) -> Row:
    started = time.perf_counter()
    sim = Sim(world, preset(name, knobs), seed)
    sim.run()
    return summarise(scenario, name, params, sim, time.perf_counter() - started, trigger, goodput)


Progress = Callable[[Row], None]


def _emit(rows: list[Row], row: Row, progress: Progress | None) -> None:
    rows.append(row)
    if progress is not None:
        progress(row)


def depth(*, depths: Sequence[int] = (1, 2, 3, 4, 5), policies: Sequence[str] = POLICIES,
          seed: int = 1, clients: int = 100, rate: float = 1000.0, duration: float = 10.0,
          knobs: Knobs = Knobs(), progress: Progress | None = None) -> list[Row]:
    """E1: every call to the target fails for the whole run, N retrying layers.

    E1 describes a 60 s outage; 10 s is the default here because naive stacks cost 3^N arrivals each
    (N=5: 2.4 million arrivals in 10 s) and every figure is flat once the breakers have opened."""
    rows: list[Row] = []
    for d in depths:
        world = World(depth=d, clients=clients, rate=rate, duration=duration, outage=(0.0, FOREVER))
        for name in policies:
            _emit(rows, run_one("depth", name, world, knobs, seed, {"depth": d}), progress)
    return rows


def transient(*, error_rates: Sequence[float] = (0.01, 0.05, 0.1, 0.2, 0.3, 0.5),
              depths: Sequence[int] = (1, 3), policies: Sequence[str] = POLICIES, seed: int = 1,
              clients: int = 100, rate: float = 1000.0, duration: float = 20.0,
              knobs: Knobs = Knobs(), progress: Progress | None = None) -> list[Row]:
    """E2: the target fails each arrival independently with the given probability."""
    rows: list[Row] = []
    for d in depths:
        for p in error_rates:
            world = World(depth=d, clients=clients, rate=rate, duration=duration, error_rate=p)
            for name in policies:
                _emit(rows, run_one("transient", name, world, knobs, seed,
                                    {"depth": d, "error_rate": p}), progress)
    return rows


def clients(*, counts: Sequence[int] = (10, 100, 1000), policies: Sequence[str] = POLICIES,
            seed: int = 1, depth: int = 1, rate: float = 100.0, duration: float = 60.0,
            knobs: Knobs = Knobs(), progress: Progress | None = None) -> list[Row]:
    """E5: the same total load from more and more clients, full outage."""
    rows: list[Row] = []
    for n in counts:
        world = World(depth=depth, clients=n, rate=rate, duration=duration, outage=(0.0, FOREVER))
        for name in policies:
            _emit(rows, run_one("clients", name, world, knobs, seed,
                                {"clients": n, "depth": depth}), progress)
    return rows


def overload(*, triggers: Sequence[float] = (2.0, 5.0, 10.0), policies: Sequence[str] = POLICIES,
             seed: int = 1, depth: int = 1, clients: int = 100, servers: int = 10,
             service: float = 0.1, load: float = 0.8, factor: float = 0.4, start: float = 15.0,
             after: float = 100.0, timeout: float = 1.0, deadline: float = 3.0,
             knobs: Knobs = Knobs(attempts=4), progress: Progress | None = None) -> list[Row]:
    """E3: a target of ``servers`` x ``service`` with a FIFO queue under open load ``load`` x
    capacity; its capacity drops to ``factor`` for T seconds. Recovery is looked for until
    ``after`` s past the trigger."""
    rows: list[Row] = []
    capacity = servers / service
    for t in triggers:
        end = start + t
        horizon = end + after + 5.0  # room for the last 5 s goodput window
        world = World(depth=depth, clients=clients, rate=load * capacity, duration=horizon,
                      deadline=deadline, timeout=timeout, service=service, servers=servers,
                      cut=(start, end, factor), horizon=horizon, settle=start, bin=0.1)
        params = {"trigger_s": t, "start_s": start, "capacity": capacity, "load": load,
                  "factor": factor, "depth": depth}
        for name in policies:
            _emit(rows, run_one("overload", name, world, knobs, seed, params, (start, end), True),
                  progress)
    return rows


def slow(*, shares: Sequence[float] = (0.02, 0.1, 0.3), policies: Sequence[str] = (
        "no-retry", "naive", "askonce", "askonce-join"), seed: int = 1, depth: int = 3,
        clients: int = 100, rate: float = 200.0, duration: float = 20.0, service: float = 0.02,
        slow_time: float = 2.0, timeout: float = 1.0, deadline: float = 3.0,
        knobs: Knobs = Knobs(), progress: Progress | None = None) -> list[Row]:
    """E11: a slow tail at the target: a share of arrivals take ``slow_time``, longer than every
    layer's per-attempt ``timeout``. Naive layers time out into retries that start the work again;
    askonce settles a timed-out try fail closed and does not retry it; ``askonce-join``: every layer
    and the target join a repeated question to the run in flight, and every layer, the client too,
    waits for a callee that joins instead of timing out (``ClientPolicy.rejoin``). The target has
    no concurrency limit here (the library's default, and the demo's slow scenario): a limit that
    grows a few requests a window cannot follow a slow tail's occupancy (``Knobs.concurrency``
    for it anyway)."""
    if knobs.concurrency == Knobs().concurrency:
        knobs = dataclasses.replace(knobs, concurrency=None)
    rows: list[Row] = []
    for share in shares:
        world = World(depth=depth, clients=clients, rate=rate, duration=duration,
                      deadline=deadline, timeout=timeout, service=service, slow_share=share,
                      slow_time=slow_time, settle=0.0)
        for name in policies:
            _emit(rows, run_one("slow", name, world, knobs, seed,
                                {"slow_share": share, "depth": depth}), progress)
    return rows


def jitter(*, clients: int = 100, policies: Sequence[str] = JITTER_POLICIES, seed: int = 1,
           service: float = 0.01,
           knobs: Knobs = Knobs(attempts=100, budget=99, backoff=Backoff(base=0.005, cap=2.0)),
           progress: Progress | None = None) -> list[Row]:
    """E6: ``clients`` clients each write once to one record at the same moment; a write that meets
    another in progress conflicts and is retried (optimistic concurrency, as in the AWS jitter
    study).

    ``full-jitter`` is the library's own backoff (:class:`~askonce.core.backoff.Backoff`, which
    every ``RetryState`` uses); ``no-jitter`` is the same capped exponential without the random
    draw. A conflict is the callers' own doing, not the target's ill health, so no bucket or breaker
    is involved."""
    rows: list[Row] = []
    # One question per client, a microsecond apart: all at once, in effect. The half step keeps
    # float rounding of the issue times from letting one more question in.
    world = World(depth=1, clients=clients, rate=1e6, even=True, duration=(clients - 0.5) / 1e6,
                  deadline=3600.0, latency=0.0, service=service, contention=True, settle=0.0)
    for name in policies:
        _emit(rows, run_one("jitter", name, world, knobs, seed,
                            {"clients": clients, "service_s": service}), progress)
    return rows


def tail(*, depths: Sequence[int] = (1, 3), policies: Sequence[str] = (
        "no-retry", "naive", "askonce", "askonce-hedge"), seed: int = 1, clients: int = 10,
        rate: float = 1000.0, duration: float = 20.0, service: float = 0.01, spread: float = 0.5,
        slow_share: float = 0.02, slow_factor: float = 20.0, timeout: float = 1.0,
        deadline: float = 3.0, knobs: Knobs = Knobs(),
        progress: Progress | None = None) -> list[Row]:
    """E12: a latency tail at the target: ``slow_share`` of arrivals take ``slow_factor`` times the
    median work ``service`` (the others ``service`` x 1 -/+ ``spread``), nothing fails, and every
    per-attempt ``timeout`` is longer than the tail, so no layer retries it. ``askonce-hedge``: the
    layer nearest the target sends a hedge after its learned latency percentile."""
    rows: list[Row] = []
    for d in depths:
        world = World(depth=d, clients=clients, rate=rate, duration=duration, deadline=deadline,
                      timeout=timeout, service=service, spread=spread, slow_share=slow_share,
                      slow_time=slow_factor * service, settle=0.0)
        for name in policies:
            _emit(rows, run_one("tail", name, world, knobs, seed,
                                {"depth": d, "slow_share": slow_share,
                                 "slow_factor": slow_factor}), progress)
    return rows


def stuck(*, slow_times: Sequence[float] = (3.0, 5.0), policies: Sequence[str] = (
        "no-retry", "naive", "askonce", "askonce-join", "askonce-async"), seed: int = 1,
        depth: int = 3, clients: int = 100, rate: float = 100.0, duration: float = 10.0,
        timeout: float = 1.0, deadline: float = 10.0, transport: bool = True,
        knobs: Knobs = Knobs(budget=3), progress: Progress | None = None) -> list[Row]:
    """E13: a target slower than every layer's timeout: every arrival's work takes ``slow_time``,
    longer than the per-attempt ``timeout`` of every layer, shorter than the question's
    ``deadline``. ``transport``: the timeout is the HTTP client's own (``World.transport_timeout``),
    which a layer keeps toward a callee that joins too; ``askonce-join`` then re-attaches every
    ``timeout`` seconds, one retry of the budget each, and answers only while ``timeout`` x
    (1 + budget) covers the work; ``askonce-async`` polls instead, which costs no budget.
    ``transport=False``: ``ClientPolicy.attempt_timeout``, which a layer lifts toward a joiner,
    so ``askonce-join`` waits. The target has no concurrency limit (as E11)."""
    if knobs.concurrency == Knobs().concurrency:
        knobs = dataclasses.replace(knobs, concurrency=None)
    rows: list[Row] = []
    for slow_time in slow_times:
        world = World(depth=depth, clients=clients, rate=rate, duration=duration,
                      deadline=deadline, timeout=timeout, transport_timeout=transport,
                      service=slow_time, settle=0.0)
        for name in policies:
            _emit(rows, run_one("stuck", name, world, knobs, seed,
                                {"slow_time": slow_time, "timeout": timeout, "depth": depth,
                                 "transport": transport}), progress)
    return rows


SCENARIOS: dict[str, Callable[..., list[Row]]] = {
    "depth": depth, "transient": transient, "clients": clients, "overload": overload,
    "slow": slow,
    "jitter": jitter,
    "tail": tail,
    "stuck": stuck,
}
