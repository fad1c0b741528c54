"""Audit of the integrations' public constructors: a misconfiguration is a ``ValueError`` at construction,
never an error (or silently odd behaviour) at the first request or scrape.

The shared policies (``askonce.client``, ``askonce.client_policy``, ``askonce.core``) are checked the same
way: :class:`Caller`, :class:`ClientPolicy`, :class:`Limits` and :class:`RetryPolicy` refuse in their own
constructors what the integrations pass on to them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from askonce import Limits, RetryPolicy
from askonce.client import Caller, ClientPolicy
from askonce.core.ledger import LedgerPolicy
from askonce.integrations.grpc import AskonceClientInterceptor, AsyncAskonceClientInterceptor
from askonce.integrations.httpx import AskonceTransport, AsyncAskonceTransport
from askonce.integrations.prometheus import LedgerCollector
from askonce.integrations.requests import AskonceAdapter, session
from askonce.ledger_store import MemoryLedger


def _report(now: float) -> Any:
    return MemoryLedger(LedgerPolicy()).report(now)


REFUSED: list[tuple[str, Callable[[], object]]] = [
    ("httpx target not callable", lambda: AskonceTransport(target="http://billing")),  # type: ignore[arg-type]
    ("async httpx target not callable", lambda: AsyncAskonceTransport(target="x")),  # type: ignore[arg-type]
    ("requests target not callable", lambda: AskonceAdapter(target="http://billing")),  # type: ignore[arg-type]
    ("session target not callable", lambda: session(target=42)),
    ("grpc idempotent holds a non-name", lambda: AskonceClientInterceptor(idempotent=[1])),  # type: ignore[list-item]
    ("aio grpc idempotent holds bytes", lambda: AsyncAskonceClientInterceptor(idempotent={b"/a/B"})),  # type: ignore[arg-type]
    ("prometheus prefix not a string", lambda: LedgerCollector(report=_report, prefix=5)),  # type: ignore[arg-type]
    ("prometheus prefix not ASCII", lambda: LedgerCollector(report=_report, prefix="d\u00e9j\u00e0")),
    ("prometheus ledger without report", lambda: LedgerCollector(object())),  # type: ignore[arg-type]
    ("prometheus report not callable", lambda: LedgerCollector(report=5)),  # type: ignore[arg-type]
    ("prometheus clock not callable", lambda: LedgerCollector(report=_report, clock=5)),  # type: ignore[arg-type]
    ("prometheus events not a bool", lambda: LedgerCollector(report=_report, events="no")),  # type: ignore[arg-type]
]


@pytest.mark.parametrize("make", [r[1] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_a_misconfiguration_is_refused_at_construction(make: Callable[[], object]) -> None:
    with pytest.raises(ValueError):
        make()


def test_a_prometheus_prefix_that_passes_is_a_valid_metric_name() -> None:
    registry = CollectorRegistry()
    registry.register(LedgerCollector(report=_report, prefix="svc_askonce2"))  # would raise if invalid


ELSEWHERE: list[Any] = [
    pytest.param(lambda: AskonceTransport(clock=5), id="clock not callable"),
    pytest.param(lambda: AskonceAdapter(sleep=5), id="sleep not callable"),
    pytest.param(lambda: AskonceClientInterceptor(random=0.5), id="random not callable"),
    pytest.param(lambda: Caller(store=object()), id="store not a store"),  # type: ignore[arg-type]
    # "no" is truthy: without the check, every POST would be retried
    pytest.param(lambda: ClientPolicy(retry_non_idempotent="no"), id="retry_non_idempotent str"),  # type: ignore[arg-type]
    pytest.param(lambda: ClientPolicy(originator="no"), id="originator str"),  # type: ignore[arg-type]
    # a str is a collection of letters: {"G", "E", "T"}, and GET itself is no longer idempotent
    pytest.param(lambda: ClientPolicy(idempotent_methods="GET"), id="idempotent_methods str"),  # type: ignore[arg-type]
    pytest.param(lambda: ClientPolicy(attempt_timeout=True), id="attempt_timeout bool"),
    pytest.param(lambda: ClientPolicy(retry_statuses=503), id="retry_statuses int (TypeError)"),  # type: ignore[arg-type]
    pytest.param(lambda: ClientPolicy(idempotency_header=5), id="idempotency_header int (AttributeError)"),  # type: ignore[arg-type]
    pytest.param(lambda: Limits(max_budget="3"), id="Limits max_budget str (TypeError)"),  # type: ignore[arg-type]
    pytest.param(lambda: Limits(max_budget=2.5), id="Limits max_budget float"),  # type: ignore[arg-type]
    pytest.param(lambda: Limits(max_budget=True), id="Limits max_budget bool"),
    pytest.param(lambda: Limits(max_deadline="3"), id="Limits max_deadline str (TypeError)"),  # type: ignore[arg-type]
    pytest.param(lambda: RetryPolicy(attempts="3"), id="RetryPolicy attempts str (TypeError)"),  # type: ignore[arg-type]
    pytest.param(lambda: RetryPolicy(attempts=2.5), id="RetryPolicy attempts float"),  # type: ignore[arg-type]
    pytest.param(lambda: RetryPolicy(budget=1.5), id="RetryPolicy budget float"),  # type: ignore[arg-type]
]


@pytest.mark.parametrize("make", ELSEWHERE)
def test_a_misconfiguration_of_the_shared_policies_is_refused_at_construction(make: Callable[[], object]) -> None:
    with pytest.raises(ValueError):
        make()
