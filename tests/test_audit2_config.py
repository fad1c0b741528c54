"""Audit 2, misconfiguration refused at construction with ``ValueError``: the core's bucket and backoff,
the breakers' registry, the report app, and the ``@askonce.retry`` decorator's ``on=``."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

import askonce
from askonce.breakers import BreakerRegistry
from askonce.core.backoff import Backoff
from askonce.core.bucket import BucketPolicy
from askonce.ledger_store import MemoryLedger
from askonce.report_app import ReportApp

REFUSED: list[Any] = [
    pytest.param(lambda: BucketPolicy(ratio="0.2"), id="bucket ratio str (TypeError)"),
    pytest.param(lambda: BucketPolicy(ratio=True), id="bucket ratio bool"),
    pytest.param(lambda: BucketPolicy(floor=None), id="bucket floor None (TypeError)"),
    pytest.param(lambda: BucketPolicy(max_tokens=False), id="bucket max_tokens bool"),
    pytest.param(lambda: BucketPolicy(max_tokens=math.nan), id="bucket max_tokens nan"),
    pytest.param(lambda: BucketPolicy(floor=math.inf), id="bucket floor inf"),
    pytest.param(lambda: Backoff(base="0.1"), id="backoff base str (TypeError)"),
    pytest.param(lambda: Backoff(cap=True), id="backoff cap bool"),
    pytest.param(lambda: Backoff(multiplier=None), id="backoff multiplier None (TypeError)"),
    pytest.param(lambda: Backoff(jitter="no"), id="backoff jitter str (truthy: jitter on)"),
    pytest.param(lambda: Backoff(jitter=0), id="backoff jitter int"),
    pytest.param(lambda: Backoff(base=math.nan), id="backoff base nan"),
    pytest.param(lambda: Backoff(cap=math.inf), id="backoff cap inf"),
    pytest.param(lambda: BreakerRegistry(clock=5), id="registry clock not callable"),  # type: ignore[arg-type]
    pytest.param(lambda: BreakerRegistry(is_failure="yes"), id="registry is_failure not callable"),  # type: ignore[arg-type]
    pytest.param(lambda: BreakerRegistry(max_targets="10"), id="registry max_targets str (TypeError)"),  # type: ignore[arg-type]
    pytest.param(lambda: BreakerRegistry(max_targets=True), id="registry max_targets bool"),
    pytest.param(lambda: BreakerRegistry(store=object()), id="registry store not a store"),  # type: ignore[arg-type]
    pytest.param(lambda: ReportApp(MemoryLedger(), prefix=5), id="report app prefix int (AttributeError)"),  # type: ignore[arg-type]
    pytest.param(lambda: ReportApp(MemoryLedger(), clock=5), id="report app clock not callable"),  # type: ignore[arg-type]
    pytest.param(lambda: ReportApp(MemoryLedger(), poll=True), id="report app poll bool"),
    pytest.param(lambda: askonce.retry(on=int), id="retry on a type that is no exception"),
    pytest.param(lambda: askonce.retry(on=object), id="retry on object"),
    pytest.param(lambda: askonce.retry(on=KeyboardInterrupt), id="retry on KeyboardInterrupt"),
    pytest.param(lambda: askonce.retry(on=(ValueError, SystemExit)), id="retry on SystemExit in a tuple"),
    pytest.param(lambda: askonce.retry(on=BaseException), id="retry on BaseException"),
    pytest.param(lambda: askonce.retry(on=[ValueError]), id="retry on a list"),  # type: ignore[arg-type]
    pytest.param(lambda: askonce.retry(on=ValueError()), id="retry on an instance"),  # type: ignore[arg-type]
    pytest.param(lambda: askonce.retry()(5), id="retry decorating a non-callable"),  # type: ignore[call-overload]
]


@pytest.mark.parametrize("make", REFUSED)
def test_a_misconfiguration_is_refused_at_construction(make: Callable[[], object]) -> None:
    with pytest.raises(ValueError):
        make()


def test_what_stays_accepted() -> None:
    BucketPolicy(ratio=0, floor=0, max_tokens=0)
    Backoff(base=0, cap=0, multiplier=1, jitter=False)
    askonce.retry(on=Exception)
    askonce.retry(on=(ConnectionError, TimeoutError))
    askonce.retry(on=lambda e: isinstance(e, ValueError))
    BreakerRegistry(max_targets=1, clock=lambda: 0.0)
