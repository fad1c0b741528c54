"""The in-process demo: the same three-layer stack, naive and with askonce, counted at the target.

Each layer tries 3 times. The naive stack uses plain retry loops (what tenacity or urllib3 defaults
do per layer); the askonce stack uses ``@askonce.retry`` with one question minted at the top. The
target counts arrivals per question key. No sockets here: the multi-service stack on 127.0.0.1 is
``askonce.demo.stack``; this one shows the arithmetic in a second.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import askonce
from askonce.core.backoff import NO_WAIT


@dataclass(frozen=True, slots=True)
class Row:
    scenario: str
    policy: str
    questions: int
    mean: float
    p99: float
    max: int
    success_rate: float

    def to_dict(self) -> dict[str, object]:
        return {
            "scenario": self.scenario,
            "policy": self.policy,
            "questions": self.questions,
            "arrivals_per_question": {"mean": self.mean, "p99": self.p99, "max": self.max},
            "success_rate": self.success_rate,
        }


class Target:
    """Fails each arrival with probability ``failure_rate``; counts arrivals per question key."""

    def __init__(self, failure_rate: float, rng: random.Random) -> None:
        self.failure_rate = failure_rate
        self.rng = rng
        self.arrivals: Counter[str] = Counter()
        self.current_key = ""

    def __call__(self) -> str:
        q = askonce.current()
        self.arrivals[q.key if q is not None else self.current_key] += 1
        if self.rng.random() < self.failure_rate:
            raise ConnectionError("target failed")
        return "ok"


def _naive_layer(inner: Callable[[], str], attempts: int = 3) -> Callable[[], str]:
    def call() -> str:
        for i in range(attempts):
            try:
                return inner()
            except ConnectionError:
                if i == attempts - 1:
                    raise
        raise AssertionError("unreachable")

    return call


def _askonce_layer(inner: Callable[[], str], name: str, attempts: int = 3) -> Callable[[], str]:
    return askonce.retry(on=ConnectionError, attempts=attempts, layer=name, backoff=NO_WAIT,
                         bucket=None)(inner)


def _percentile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


def run(scenario: str, policy: str, failure_rate: float, *, depth: int = 3, questions: int = 1000,
        budget: int = 2, seed: int = 1) -> Row:
    target = Target(failure_rate, random.Random(seed))
    call: Callable[[], str] = target
    for level in range(depth, 0, -1):
        call = _naive_layer(call) if policy == "naive" else _askonce_layer(call, f"layer{level}")
    ok = 0
    for n in range(questions):
        if policy == "naive":
            target.current_key = f"q{n}"
            try:
                call()
                ok += 1
            except ConnectionError:
                pass
        else:
            with askonce.question(budget=budget, deadline=None):
                try:
                    call()
                    ok += 1
                except (ConnectionError, askonce.AskonceError):
                    pass
    counts = list(target.arrivals.values())
    return Row(scenario, policy, questions, sum(counts) / questions, _percentile(counts, 0.99),
               max(counts), ok / questions)


def rows(questions: int = 1000, depth: int = 3, budget: int = 2) -> list[Row]:
    out = []
    for scenario, rate in (("outage", 1.0), ("transient", 0.1)):
        for policy in ("naive", "askonce"):
            out.append(run(scenario, policy, rate, depth=depth, questions=questions, budget=budget))
    return out
