"""The client's policy and the Caller refuse at construction what they would otherwise misread (a
``ValueError`` naming the value), normalise what they accept, and keep accepting every valid setting."""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from typing import Any

import pytest

from askonce import Limits, RetryPolicy
from askonce.client import Caller, ClientPolicy
from askonce.core.breaker import BreakerPolicy
from askonce.core.bucket import BucketPolicy
from askonce.stores.memory import MemoryStore


@pytest.mark.parametrize(
    "kw",
    [
        {"layer": "no spaces"},
        {"layer": ""},
        {"retry_statuses": frozenset({700})},
        {"retry_statuses": frozenset({True})},
        {"idempotent_methods": frozenset({"G ET"})},
        {"idempotency_header": "Idem Key"},
        {"attempt_timeout": 0},
        {"attempt_timeout": -1.0},
        {"max_discard": -1},
        {"retry": 3},
        {"bucket": 0.1},
        {"breaker": "on"},
    ],
)
def test_bad_policies_are_refused(kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        ClientPolicy(**kw)


def test_policy_sets_are_normalised() -> None:
    p = ClientPolicy(retry_statuses={503}, idempotent_methods={"get"})  # type: ignore[arg-type]
    assert p.retry_statuses == frozenset({503}) and p.idempotent_methods == frozenset({"GET"})
    hash(p)


REFUSED: list[Any] = [
    pytest.param(lambda: Caller(store=object()), id="store not a store"),  # type: ignore[arg-type]
    # "no" is truthy: without the check, every POST would be retried
    pytest.param(lambda: ClientPolicy(retry_non_idempotent="no"), id="retry_non_idempotent str"),  # type: ignore[arg-type]
    pytest.param(lambda: ClientPolicy(originator="no"), id="originator str"),  # type: ignore[arg-type]
    # a str is a collection of letters: {"G", "E", "T"}, and GET itself is no longer idempotent
    pytest.param(lambda: ClientPolicy(idempotent_methods="GET"), id="idempotent_methods str"),  # type: ignore[arg-type]
    pytest.param(lambda: ClientPolicy(attempt_timeout=True), id="attempt_timeout bool"),
    pytest.param(lambda: ClientPolicy(retry_statuses=503), id="retry_statuses int (TypeError)"),  # type: ignore[arg-type]
    pytest.param(lambda: ClientPolicy(idempotency_header=5), id="idempotency_header int (AttributeError)"),  # type: ignore[arg-type]
]


@pytest.mark.parametrize("make", REFUSED)
def test_a_misconfiguration_is_refused_at_construction(make: Callable[[], object]) -> None:
    with pytest.raises(ValueError):
        make()


NAMED: list[Any] = [
    pytest.param(lambda: Caller(clock=5), id="clock"),  # type: ignore[arg-type]
    pytest.param(lambda: Caller(sleep="soon"), id="sleep"),  # type: ignore[arg-type]
    pytest.param(lambda: Caller(random=0.5), id="random"),  # type: ignore[arg-type]
    pytest.param(lambda: Caller(store=object()), id="store"),  # type: ignore[arg-type]
    pytest.param(lambda: ClientPolicy(throttle_statuses="429"), id="throttle_statuses str"),  # type: ignore[arg-type]
    pytest.param(lambda: ClientPolicy(retry_statuses=[503, "504"]), id="retry_statuses holds a str"),  # type: ignore[arg-type]
    pytest.param(lambda: ClientPolicy(idempotent_methods=["GET", 1]), id="idempotent_methods holds an int"),  # type: ignore[arg-type]
    pytest.param(lambda: ClientPolicy(idempotent_methods=[["GET"]]), id="idempotent_methods unhashable"),  # type: ignore[arg-type]
    pytest.param(lambda: ClientPolicy(idempotency_header=b"Idempotency-Key"), id="idempotency_header bytes"),  # type: ignore[arg-type]
    pytest.param(lambda: ClientPolicy(attempt_timeout=math.nan), id="attempt_timeout nan"),
    pytest.param(lambda: ClientPolicy(retry_non_idempotent=1), id="retry_non_idempotent int"),  # type: ignore[arg-type]
]


@pytest.mark.parametrize("make", NAMED)
def test_a_misconfiguration_is_a_value_error_naming_the_value(make: Any) -> None:
    with pytest.raises(ValueError, match=r"got|not a single"):
        make()


def test_valid_policies_and_callers_stay_accepted() -> None:
    p = ClientPolicy(retry_statuses=[503], idempotent_methods=("get", "put"),  # type: ignore[arg-type]
                     attempt_timeout=2, idempotency_header=None, originator=True)
    assert p.retry_statuses == frozenset({503}) and p.idempotent_methods == frozenset({"GET", "PUT"})
    assert Limits(max_budget=0, max_deadline=5).max_deadline == 5
    assert RetryPolicy(attempts=1, budget=0, deadline=None, max_pushback=0).attempts == 1

    class BucketsOnly:  # a store without breakers still serves a policy without a breaker
        def bucket(self, target: str, policy: Any) -> Any:
            return MemoryStore(lambda: 0.0).bucket(target, policy)

    store: Any = BucketsOnly()
    Caller(ClientPolicy(), store=store, clock=lambda: 0.0, sleep=lambda s: None, random=lambda: 0.5)

    class BreakersOnly:  # and one without buckets a policy without a bucket
        def breaker(self, target: str, policy: Any) -> Any:
            return MemoryStore(lambda: 0.0).breaker(target, policy)

    store = BreakersOnly()
    Caller(ClientPolicy(bucket=None, breaker=BreakerPolicy()), store=store)
    with pytest.raises(ValueError, match="bucket"):
        Caller(ClientPolicy(bucket=BucketPolicy(), breaker=BreakerPolicy()), store=store)

    class Tries(enum.IntEnum):  # integers read from configuration as an IntEnum are integers
        THREE = 3

    assert RetryPolicy(attempts=Tries.THREE, budget=Tries.THREE).attempts == 3
    assert Limits(max_budget=Tries.THREE).max_budget == 3
