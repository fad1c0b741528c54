"""What the demo runs: the scenarios, each layer's settings, and the pure schedules behind them.

Everything here is a frozen value or a pure function (seeded randomness, time as an input), so the
runner, the processes and the tests agree on one description and a run can be repeated exactly.
Settings travel to the processes as JSON (``to_json`` / ``from_json``), validated on arrival.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Literal, TypeVar

from askonce.core import is_real
from askonce.core.breaker import BreakerPolicy
from askonce.core.question import mint_key

Mode = Literal["naive", "askonce"]
POLICIES = ("no-retry", "naive", "askonce")
SCENARIOS = ("outage", "transient", "slow", "tail", "overload", "stuck")
FAILURES = ("none", "outage", "transient", "slow")
# httpx's own default: the middle layers' per-attempt timeout unless a scenario says otherwise.
DEFAULT_TIMEOUT = 5.0

# The layer nearest the target opens on a run of failures: 90 % of its last 20 calls (3 at least),
# so a dead target is cut off at the third failure in a row, while at 10 % independent failures it
# opens only when 3 of the first 3 calls fail (p = 0.001) or 18 of 20 do. It probes after 1 s.
# Together with the demo's budget of 3 this keeps an outage to at most 3 arrivals per question (the
# breaker stops the fourth try) while a question that drew three transient failures still gets its
# fourth (docs/demo.md).
DEMO_BREAKER = BreakerPolicy(window="count", window_size=20, minimum_calls=3, failure_rate=0.9,
                             open_for=1.0, half_open_probes=1)
DEMO_BUDGET = 3
# ClientPolicy.deadline_grace of every askonce client in the demo (--grace): off, as in the
# library. A grace turns timed-out tries in the overload into retries, which slows its recovery
# (docs/demo.md).
DEMO_GRACE = 0.0

S = TypeVar("S")


def _check(ok: bool, what: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{what}, got {value!r}")


def _number(value: object) -> bool:
    return is_real(value) and math.isfinite(value)


def from_json(cls: type[S], data: object) -> S:
    """A settings object from the JSON a control endpoint received; unknown keys are refused."""
    if not isinstance(data, dict):
        raise ValueError(f"{cls.__name__} must be a JSON object, got {type(data).__name__}")
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    unknown = set(data) - names
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown settings {sorted(unknown)}")
    values = {k: tuple(tuple(x) for x in v) if k == "capacity" else v for k, v in data.items()}
    return cls(**values)


@dataclass(frozen=True, slots=True)
class LayerSettings:
    """One middle layer (gateway, api, service) for one run.

    ``naive``: a plain loop of ``attempts`` tries with full-jitter exponential backoff
    (``backoff_base`` doubling, capped at ``backoff_cap``), retrying connection errors, timeouts and
    502/503/504, each try limited to ``timeout`` seconds, forwarding only ``x-question-id``.
    ``askonce``: the askonce client (same attempts, backoff and per-attempt timeout) under the
    askonce server middleware; ``breaker`` puts a circuit breaker on the calls to the next layer;
    ``respond_async``: each try asks ``Prefer: respond-async`` (``ClientPolicy.respond_async``).
    """

    mode: Mode = "naive"
    downstream: str = ""
    attempts: int = 3
    timeout: float = DEFAULT_TIMEOUT
    backoff_base: float = 0.05
    backoff_cap: float = 1.0
    breaker: bool = False
    grace: float = DEMO_GRACE
    seed: int = 1
    redis: str | None = None
    prefix: str = "askonce-demo"
    join: bool = True
    hedge: bool = False
    respond_async: bool = False

    def __post_init__(self) -> None:
        _check(self.mode in ("naive", "askonce"), "mode must be 'naive' or 'askonce'", self.mode)
        _check(type(self.join) is bool, "join must be true or false", self.join)
        _check(type(self.hedge) is bool, "hedge must be true or false", self.hedge)
        _check(type(self.respond_async) is bool, "respond_async must be true or false",
               self.respond_async)
        _check(isinstance(self.downstream, str), "downstream must be a URL", self.downstream)
        _check(_number(self.grace) and 0 <= self.grace <= 10, "grace must be seconds within 0..10",
               self.grace)
        _check(type(self.attempts) is int and 1 <= self.attempts <= 10,
               "attempts must be within 1..10", self.attempts)
        for name in ("timeout", "backoff_base", "backoff_cap"):
            value = getattr(self, name)
            _check(_number(value) and 0 <= value <= 60, f"{name} must be seconds within 0..60",
                   value)
        _check(self.timeout > 0, "timeout must be positive", self.timeout)
        _check(self.redis is None or isinstance(self.redis, str), "redis must be a URL or null",
               self.redis)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class TargetSettings:
    """The target for one run: ``slots`` workers of ``service_time`` seconds each behind a FIFO
    queue.

    ``failure``: ``outage`` answers 503 to every arrival at once; ``transient`` answers 503 at once
    to a share ``rate`` of arrivals; ``slow`` makes a share ``slow_share`` of arrivals take
    ``slow_time`` instead of ``service_time``. Which arrivals fail or are slow is a hash of the
    seed, the question id and the arrival's number for that id: independent draws, the same for
    every policy. ``capacity``: ``(start, end, factor)`` in seconds after ``t0`` (wall clock):
    between them the service time is divided by ``factor``. ``concurrency``: in askonce mode, the
    middleware keeps an adaptive concurrency limit (``ConcurrencyPolicy()``), refusing what is
    over it with 503 ``r=overloaded``.
    """

    mode: Mode = "naive"
    slots: int = 8
    service_time: float = 0.1
    failure: str = "none"
    rate: float = 0.0
    slow_share: float = 0.0
    slow_time: float = 0.0
    capacity: tuple[tuple[float, float, float], ...] = ()
    t0: float = 0.0
    seed: int = 1
    redis: str | None = None
    prefix: str = "askonce-demo"
    join: bool = True
    concurrency: bool = False

    def __post_init__(self) -> None:
        _check(self.mode in ("naive", "askonce"), "mode must be 'naive' or 'askonce'", self.mode)
        _check(type(self.join) is bool, "join must be true or false", self.join)
        _check(type(self.concurrency) is bool, "concurrency must be true or false",
               self.concurrency)
        _check(type(self.slots) is int and 1 <= self.slots <= 1000, "slots must be within 1..1000",
               self.slots)
        _check(self.failure in FAILURES, f"failure must be one of {FAILURES}", self.failure)
        for name in ("rate", "slow_share"):
            value = getattr(self, name)
            _check(_number(value) and 0 <= value <= 1, f"{name} must be within 0..1", value)
        for name in ("service_time", "slow_time"):
            value = getattr(self, name)
            _check(_number(value) and 0 <= value <= 60, f"{name} must be seconds within 0..60",
                   value)
        _check(isinstance(self.capacity, tuple) and all(
            len(c) == 3 and all(_number(x) for x in c) and c[2] > 0 for c in self.capacity),
            "capacity must be (start, end, factor > 0) triples", self.capacity)
        _check(_number(self.t0), "t0 must be a wall-clock time", self.t0)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def layer_attempts(policy: str, budget: int) -> int:
    """Tries per call at each middle layer: none again for no-retry, 3 for naive; for askonce
    enough for the whole budget, which is what bounds it (only the layer nearest the failure
    retries: ``RetryPolicy.one_layer``)."""
    if policy == "no-retry":
        return 1
    default = LayerSettings().attempts
    return max(default, 1 + budget) if policy == "askonce" else default


def capacity_factor(capacity: tuple[tuple[float, float, float], ...], t: float) -> float:
    """The target's capacity factor ``t`` seconds into a run (1.0 outside every cut)."""
    for start, end, factor in capacity:
        if start <= t < end:
            return factor
    return 1.0


def draw(seed: int, what: str, key: str, n: int) -> float:
    """A uniform draw in [0, 1) that depends only on its inputs (the target's failure and
    slowness)."""
    digest = hashlib.blake2b(f"{seed}|{what}|{key}|{n}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def poisson_schedule(rate: float, duration: float, seed: int) -> list[float]:
    """Launch times (seconds from the start) of an open Poisson load of ``rate`` per second."""
    if not (_number(rate) and rate > 0 and _number(duration) and duration >= 0):
        raise ValueError(f"rate must be > 0 and duration >= 0, got {rate!r}, {duration!r}")
    rng = random.Random(seed)
    out: list[float] = []
    t = rng.expovariate(rate)
    while t < duration:
        out.append(t)
        t += rng.expovariate(rate)
    return out


def question_keys(n: int, seed: int, scenario: str) -> list[str]:
    """Question keys in the askonce format, the same for every policy of a scenario (paired
    runs)."""
    rng = random.Random(f"{seed}:{scenario}")
    return [mint_key(1_700_000_000_000 + i, rng.randbytes(16)) for i in range(n)]


@dataclass(frozen=True, slots=True)
class Trigger:
    """The overload trigger: capacity times ``factor`` from ``start`` for ``length`` seconds."""

    start: float
    length: float
    factor: float

    @property
    def end(self) -> float:
        return self.start + self.length


@dataclass(frozen=True, slots=True)
class Scenario:
    """One scenario: the load, what the target does, and how the edge and the layers try.

    ``rate`` questions per second (Poisson) for ``duration`` seconds. The edge asks with
    ``deadline`` seconds in all; ``edge_attempts`` tries of at most ``edge_timeout`` each (a naive
    edge retries the way the layers do). ``layer_timeout``: each middle layer's per-attempt timeout.
    ``window``: the goodput window of the recovery time (overload).
    """

    name: str
    rate: float
    duration: float
    target: TargetSettings
    policies: tuple[str, ...] = ("naive", "askonce")
    deadline: float = 3.0
    edge_attempts: int = 1
    edge_timeout: float = 3.0
    layer_timeout: float = DEFAULT_TIMEOUT
    trigger: Trigger | None = None
    window: float = 5.0
    budget: int = DEMO_BUDGET
    grace: float = DEMO_GRACE  # the askonce clients' deadline_grace
    join: bool = True  # askonce layers and the target join repeated arrivals of a question
    breaker: bool = False  # askonce: DEMO_BREAKER on the layer nearest the target (--breaker)
    hedge: bool = False  # askonce: the layer nearest the target hedges (ClientPolicy.hedge)
    # askonce: the edge and every layer ask respond-async (ClientPolicy.respond_async), with join
    respond_async: bool = False
    # The target's slow arrivals take this many times the stack's own median answer, which a short
    # run of fast calls measures first (demo.runner): "20x the median" as the edge sees it, on any
    # machine. None: ``target.slow_time`` as set.
    slow_factor: float | None = None
    note: str = ""


def scenarios(quick: bool = False, seed: int = 1, budget: int = DEMO_BUDGET,
              grace: float = DEMO_GRACE, join: bool = True, breaker: bool = False,
              error_rates: tuple[float, ...] = ()) -> dict[str, Scenario]:
    """The six scenarios with their parameters; ``quick`` shortens every one (fewer questions).

    ``budget``: the retries each askonce question may cost in all (minted at the edge).
    ``error_rates``: the transient scenario's sweep, one scenario ``transient-<percent>`` per rate
    (no-retry, naive and askonce; 1,000 questions each, 180 with ``quick``), after the six.
    """
    if type(budget) is not int or not 0 <= budget <= 10:
        raise ValueError(f"budget must be an integer within 0..10, got {budget!r}")
    q = quick
    before, cut, after = (0.8, 2.0, 1.5) if q else (1.5, 10.0, 8.5)
    out = {
        "outage": Scenario(
            "outage", rate=20.0, duration=0.8 if q else 1.5,
            target=TargetSettings(failure="outage", seed=seed),
            note="the target answers 503 to every call"),
        "transient": Scenario(
            # About 3,000 questions: the mean arrivals per question then has a standard error of
            # ~0.006, so the 1.111 expected at 10 % sits clear of the 1.12 goal (500 questions:
            # 0.015, a coin toss). 100 a second: the whole stack then needs about 60 % of a
            # 2-core machine's CPU with askonce, and a slower or busier one still keeps up.
            "transient", rate=100.0, duration=1.8 if q else 30.0,
            target=TargetSettings(failure="transient", rate=0.1, service_time=0.01, slots=64,
                                  seed=seed),
            note="10% of arrivals fail at once (independent seeded draws)"),
        "slow": Scenario(
            "slow", rate=40.0, duration=1.0 if q else 2.0, layer_timeout=1.0,
            target=TargetSettings(failure="slow", slow_share=0.1, slow_time=2.0,
                                  service_time=0.02, slots=64, seed=seed),
            note="10% of arrivals take 2 s; every layer's per-attempt timeout is 1 s"),
        "tail": Scenario(
            # 1,000 questions: the service learns its callee's latency from its first 100 answers
            # (HedgePolicy.min_samples) and hedges from then on. At half the transient's rate: the
            # hedge waits the learned 97th percentile, which a stack near its CPU's limit stretches
            # (its queueing, not the target's tail), so the load stays well below a busy 2-core
            # machine's knee.
            # The slow share takes 20x the stack's median answer (50 ms of work and the stack's
            # own time): a busy machine's stack time stretches the median, and a slow call of a
            # fixed 1 s would be a milder tail there than the scenario means. The deadline, within
            # every layer's timeout, leaves room for a median up to 200 ms (demo.runner.MAX_SLOW).
            "tail", rate=50.0, duration=4.0 if q else 20.0, deadline=5.0, edge_timeout=5.0,
            target=TargetSettings(failure="slow", slow_share=0.02, slow_time=1.0,
                                  service_time=0.05, slots=64, seed=seed),
            hedge=True, join=False, slow_factor=20.0,
            note="2% of arrivals take 20x the stack's median (measured first); no timeout is "
                 "that short; askonce: the service hedges after its learned 97th percentile"),
        "overload": Scenario(
            "overload", rate=64.0, duration=before + cut + after,
            target=TargetSettings(slots=8, service_time=0.1, seed=seed, concurrency=True),
            policies=("no-retry", "naive", "askonce"), edge_attempts=4, edge_timeout=1.0,
            trigger=Trigger(before, cut, 0.2), window=1.0 if q else 5.0,
            note=f"8 workers x 100 ms = 80/s; open load 64/s; capacity cut to 20% for {cut:g} s; "
                 "3 s deadline, 1 s per attempt"),
        "stuck": Scenario(
            # A few dozen questions: naive layers send 27 arrivals of 3 s each per question, which
            # the target's workers (enough for all of them) and the api's threads still hold.
            "stuck", rate=8.0, duration=1.5 if q else 3.0, layer_timeout=1.0, deadline=10.0,
            edge_timeout=10.0,
            target=TargetSettings(service_time=3.0, slots=1000, seed=seed),
            policies=("no-retry", "naive", "askonce"), respond_async=True,
            note="every arrival takes 3 s; every layer's per-attempt timeout is 1 s; 10 s "
                 "deadline; askonce: every layer asks respond-async and polls for the answer"),
    }
    for rate in error_rates:
        if not (_number(rate) and 0 <= rate <= 1):
            raise ValueError(f"an error rate must be within 0..1, got {rate!r}")
        name = sweep_name(rate)
        out[name] = replace(
            out["transient"], name=name, duration=1.8 if q else 10.0,
            policies=POLICIES, target=replace(out["transient"].target, rate=rate),
            note=f"{100 * rate:g}% of arrivals fail at once (independent seeded draws)")
    if not (_number(grace) and 0 <= grace <= 10):
        raise ValueError(f"grace must be seconds within 0..10, got {grace!r}")
    # The tail's target does not join: a hedge to a callee that joins would wait for the slow run
    # it is meant to overtake (hedging helps where the delay is on the way, or in one replica).
    # Async mode is a joining callee's: without joins the layers wait (or time out) as before.
    return {name: replace(s, budget=budget, grace=grace, join=join and s.join, breaker=breaker,
                          respond_async=join and s.respond_async)
            for name, s in out.items()}


def sweep_name(rate: float) -> str:
    """The name of the transient scenario at ``rate`` in a sweep: ``transient-50`` for 0.5."""
    return f"transient-{100 * rate:g}"


def kind(name: str) -> str:
    """Which of :data:`SCENARIOS` a scenario is (a sweep's ``transient-50`` is a transient)."""
    return name.split("-", 1)[0]
