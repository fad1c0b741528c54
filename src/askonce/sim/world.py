"""What a simulation runs and what it counts: the stack's policy, the world it runs in, raw counts.

Both configurations are frozen and validated (``ValueError``); :class:`Stats` is filled by
:class:`askonce.sim.model.Sim` and turned into figures by :func:`askonce.sim.scenarios.summarise`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from askonce.core.admission import AdmissionPolicy
from askonce.core.backoff import Backoff
from askonce.core.breaker import BreakerPolicy
from askonce.core.bucket import BucketPolicy
from askonce.core.concurrency import ConcurrencyPolicy
from askonce.core.hedge import HedgePolicy
from askonce.core.wire import MAX_ATTEMPT, MAX_BUDGET, MAX_HOPS, Limits, valid_name


@dataclass(frozen=True, slots=True)
class Policy:
    """What every layer of a simulated stack does about failures (presets: ``scenarios``)."""

    name: str
    attempts: int = 3  # per layer
    propagate: bool = False  # forward the question (budget, deadline, path) and read the replies
    budget: int = 2  # the question's retries, when propagated
    backoff: Backoff = Backoff()
    bucket: BucketPolicy | None = None  # a retry token bucket per layer instance
    breaker: BreakerPolicy | None = None  # a circuit breaker per layer instance...
    breaker_everywhere: bool = True  # ...on every layer, or only on the layer nearest the target
    admission: AdmissionPolicy | None = None  # adaptive admission on the layer nearest the target
    shared: bool = False  # layer 1's bucket and breaker shared by every client (fleet-wide store)
    shed: bool = False  # the target refuses, and cancels, work past the propagated deadline
    # with propagate: the target's adaptive concurrency limit (refusing 503 r=overloaded over it)
    concurrency: ConcurrencyPolicy | None = None
    grace: float = 0.0  # ClientPolicy.deadline_grace of the propagating layers (0: off)
    join: bool = False  # layers and target join a repeated question; timed-out tries re-attach
    edge_rejoins: bool = False  # with join: layer 1 (the client) re-attaches too
    # with propagate: the layer nearest the target hedges slow first tries (ClientPolicy.hedge)
    hedge: HedgePolicy | None = None
    # with join: every layer that rejoins asks ``Prefer: respond-async``
    # (ClientPolicy.respond_async) and polls the callee's status location instead of waiting on,
    # or timing out of, the try
    respond_async: bool = False

    def __post_init__(self) -> None:
        if not valid_name(self.name):
            raise ValueError(f"policy name must be a name like 'naive', got {self.name!r}")
        if not 1 <= self.attempts <= MAX_ATTEMPT:
            raise ValueError(f"attempts must be within 1..{MAX_ATTEMPT}, got {self.attempts!r}")
        if not 0 <= self.budget <= MAX_BUDGET:
            raise ValueError(f"budget must be within 0..{MAX_BUDGET}, got {self.budget!r}")
        if not 0 <= self.grace <= 10:
            raise ValueError(f"grace must be within 0..10 s, got {self.grace!r}")
        if self.hedge is not None and not (isinstance(self.hedge, HedgePolicy)
                                           and self.propagate):
            raise ValueError(f"hedge must be a HedgePolicy, with propagate=True, "
                             f"got {self.hedge!r}")
        if self.respond_async is not False and not (self.respond_async is True and self.join
                                                    and self.propagate and self.hedge is None):
            raise ValueError(f"respond_async must be True or False, True only with join=True, "
                             f"propagate=True and no hedge, got {self.respond_async!r}")


# Per run (rate x duration): beyond it a run takes hours and memory without end.
MAX_QUESTIONS = 100_000_000


@dataclass(frozen=True, slots=True)
class World:
    """The stack, the load and the trouble. Times are virtual seconds."""

    depth: int = 3  # retrying layers; layer 1 is the client, which mints the question
    clients: int = 100
    rate: float = 1000.0  # questions per second, all clients together
    duration: float = 60.0  # questions are issued in [0, duration)
    even: bool = False  # evenly spaced questions, round-robin over clients, not a Poisson stream
    deadline: float = 3.0  # the question's deadline; success is counted only within it
    timeout: float | None = None  # per-attempt timeout at every layer
    # the timeout is the HTTP client's own (httpx's timeout=), which a layer keeps toward a callee
    # that joins too; False: ClientPolicy.attempt_timeout, which it lifts there (rejoin)
    transport_timeout: bool = False
    latency: float = 0.001  # one-way delay of every hop
    service: float = 0.01  # the target's work per arrival
    slow_share: float = 0.0  # each arrival's work takes slow_time instead, with this probability
    slow_time: float = 0.0
    spread: float = 0.0  # the other arrivals' work is service x a uniform draw in 1 -/+ spread
    servers: int | None = None  # None: the target serves every arrival at once; else a FIFO queue
    error_rate: float = 0.0  # each arrival fails independently with this probability
    outage: tuple[float, float] | None = None  # every arrival in [start, end) fails
    cut: tuple[float, float, float] | None = None  # (start, end, factor): capacity times factor
    contention: bool = False  # one shared record: an arrival during a write conflicts
    horizon: float | None = None  # stop here; None: run until every question is done
    settle: float = 5.0  # questions minted before this are left out of the steady figures
    bin: float = 1.0  # seconds per bin of the time series
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self) -> None:
        if not 1 <= self.depth <= MAX_HOPS:
            raise ValueError(f"depth must be within 1..{MAX_HOPS}, got {self.depth!r}")
        if not 1 <= self.clients <= 1_000_000:
            raise ValueError(f"clients must be within 1..1000000, got {self.clients!r}")
        for name in ("rate", "duration", "deadline", "bin"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be a positive finite number, "
                                 f"got {getattr(self, name)!r}")
        for name in ("latency", "service", "settle"):
            if not 0 <= getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0, "
                                 f"got {getattr(self, name)!r}")
        if self.timeout is not None and not 0 < self.timeout < float("inf"):
            raise ValueError(f"timeout must be None or positive, got {self.timeout!r}")
        if self.servers is not None and not 1 <= self.servers <= 1_000_000:
            raise ValueError(f"servers must be None or within 1..1000000, got {self.servers!r}")
        if not 0 <= self.slow_share <= 1 or not 0 <= self.slow_time < float("inf"):
            raise ValueError(f"slow_share must be within 0..1 and slow_time a finite number >= 0, "
                             f"got {self.slow_share!r}, {self.slow_time!r}")
        if not 0 <= self.spread < 1:
            raise ValueError(f"spread must be within [0, 1), got {self.spread!r}")
        if not 0 <= self.error_rate <= 1:
            raise ValueError(f"error_rate must be within 0..1, got {self.error_rate!r}")
        if self.cut is not None and not (self.cut[0] <= self.cut[1] and 0 < self.cut[2] <= 1):
            raise ValueError(f"cut must be (start <= end, factor in (0, 1]), got {self.cut!r}")
        if self.horizon is not None and not 0 < self.horizon < float("inf"):
            raise ValueError(f"horizon must be None or positive, got {self.horizon!r}")
        if self.rate * self.duration > MAX_QUESTIONS:
            raise ValueError(f"rate x duration is {self.rate * self.duration:.3g} questions; "
                             f"at most {MAX_QUESTIONS:.0e}")


class Question(Protocol):
    """What :class:`Stats` reads of a question (``askonce.sim.model.Asked``)."""

    born: float
    due: float
    arrivals: int
    polls: int


class Stats:
    """Raw counts of one run; ``scenarios.summarise`` turns them into figures."""

    __slots__ = ("answered", "arrival_bins", "arrivals", "bin", "busy", "goodput_bins", "hist",
                 "issued", "issued_bins", "last_ok", "latency_ms", "ok", "overloaded", "poll_max",
                 "polls", "settle", "shed", "steady", "trace", "unfinished", "wasted")  # fmt: skip

    def __init__(self, world: World) -> None:
        self.bin = world.bin
        self.settle = world.settle
        self.issued = self.answered = self.ok = self.arrivals = self.shed = self.unfinished = 0
        self.overloaded = 0  # arrivals the target's concurrency limit refused
        # Status polls of an async try (respond_async): never arrivals of the question.
        self.polls = self.poll_max = 0
        self.last_ok = 0.0  # when the last success within the deadline came back
        # Seconds of target work, and of work for callers who had gone.
        self.busy = self.wasted = 0.0
        self.hist: dict[int, int] = {}  # arrivals at the target -> questions, every question
        self.steady: dict[int, int] = {}  # the same, for questions minted after ``settle``
        self.latency_ms: dict[int, int] = {}  # successes by whole milliseconds
        self.goodput_bins: list[int] = []  # successes within the deadline, by completion time
        self.arrival_bins: list[int] = []
        self.issued_bins: list[int] = []  # questions asked, by when (``issue``)
        # (minted at, arrivals) per question, if asked for.
        self.trace: list[tuple[float, int]] | None = None

    @staticmethod
    def _bump(bins: list[int], i: int) -> None:
        if i >= len(bins):
            bins.extend([0] * (i + 1 - len(bins)))
        bins[i] += 1

    def issue(self, now: float) -> None:
        self.issued += 1
        bins, i = self.issued_bins, int(now / self.bin)
        if i < len(bins):  # _bump, inline: once per question
            bins[i] += 1
        else:
            self._bump(bins, i)

    def arrival(self, now: float) -> None:
        self.arrivals += 1
        bins, i = self.arrival_bins, int(now / self.bin)
        if i < len(bins):  # _bump, inline: once per arrival
            bins[i] += 1
        else:
            self._bump(bins, i)

    def answer(self, q: Question, ok: bool, now: float) -> None:
        self.answered += 1
        if ok and now <= q.due:
            self.ok += 1
            self.last_ok = now
            bins, i = self.goodput_bins, int(now / self.bin)
            if i < len(bins):  # _bump, inline: once per success
                bins[i] += 1
            else:
                self._bump(bins, i)
            ms = int((now - q.born) * 1000)
            self.latency_ms[ms] = self.latency_ms.get(ms, 0) + 1

    def close(self, q: Question) -> None:
        n = q.arrivals
        if q.polls > self.poll_max:
            self.poll_max = q.polls
        self.hist[n] = self.hist.get(n, 0) + 1
        if self.trace is not None:
            self.trace.append((q.born, n))
        if q.born >= self.settle:
            self.steady[n] = self.steady.get(n, 0) + 1
