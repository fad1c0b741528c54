"""Prometheus metrics from the ledger: names per convention, counters that never go down, bounded labels."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.parser import text_string_to_metric_families

import askonce
from askonce._stats import count
from askonce.core.ledger import LedgerPolicy, Report
from askonce.integrations.prometheus import LedgerCollector, register
from askonce.ledger.store import MemoryLedger

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def scrape(registry: CollectorRegistry) -> Samples:
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


@pytest.fixture
def setup() -> Iterator[tuple[MemoryLedger, Clock, CollectorRegistry]]:
    ledger = MemoryLedger(LedgerPolicy(window=10.0, windows_kept=1))
    clock = Clock(1.0)
    registry = CollectorRegistry()
    register(ledger, registry, clock=clock)
    yield ledger, clock, registry


def test_figures_per_operation(setup: tuple[MemoryLedger, Clock, CollectorRegistry]) -> None:
    ledger, _, registry = setup
    for key, path in [("q1", (("gw", 1),)), ("q1", (("gw", 2),)), ("q1", (("gw", 2),)), ("q2", ())]:
        ledger.record(1.0, "GET /items/{id}", key=key, edge=True, path=path)
    ledger.record(1.0, "GET /items/{id}", key="m1", origin="api")
    ledger.record(1.0, "GET /items/{id}", key=None)
    ledger.note_dropped(2, "buffer-full")
    s = scrape(registry)
    op = "GET /items/{id}"
    assert value(s, "askonce_ledger_arrivals_total", operation=op, kind="attributable") == 4
    assert value(s, "askonce_ledger_arrivals_total", operation=op, kind="reminted") == 1
    assert value(s, "askonce_ledger_arrivals_total", operation=op, kind="unkeyed") == 1
    assert value(s, "askonce_ledger_distinct_keys_total", operation=op) == 2
    assert value(s, "askonce_ledger_undeclared_retries_total", operation=op) == 1
    assert value(s, "askonce_ledger_retries_total", operation=op, layer="gw") == 2
    assert value(s, "askonce_ledger_reminted_total", operation=op, origin="api") == 1
    assert value(s, "askonce_ledger_refused_total", operation=op) == 0
    assert value(s, "askonce_ledger_dropped_total", reason="buffer-full") == 2
    assert value(s, "askonce_ledger_amplification", operation=op) == 2.0
    assert value(s, "askonce_ledger_coverage_ratio", operation=op) == pytest.approx(4 / 6)
    assert value(s, "askonce_ledger_arrivals_per_key", operation=op, stat="max") == 3
    assert value(s, "askonce_ledger_approximate", operation=op) == 0
    assert value(s, "askonce_ledger_report_errors_total") == 0


def test_counters_never_go_down_when_windows_roll_and_leave_the_report() -> None:
    ledger = MemoryLedger(LedgerPolicy(window=10.0, windows_kept=1))
    clock = Clock(1.0)
    listed, unlisted = CollectorRegistry(), CollectorRegistry()
    register(ledger, listed, clock=clock, operations=["op"])
    register(ledger, unlisted, clock=clock)
    seen: list[float | None] = []
    seen_unlisted: list[float | None] = []
    for t, n in [(1.0, 3), (5.0, 2), (12.0, 4), (25.0, 1), (41.0, 0), (60.0, 5)]:
        for i in range(n):
            ledger.record(t, "op", key=f"k{t}-{i}", edge=True)
        clock.now = t
        for registry, out in ((listed, seen), (unlisted, seen_unlisted)):
            out.append(value(scrape(registry), "askonce_ledger_arrivals_total", operation="op",
                             kind="attributable"))
    assert seen == [3, 5, 9, 10, 10, 15]  # windows 0 and 10 left the report on the way: still counted
    # Unlisted, "op" is forgotten when no window shows it (t=41) and starts again when it comes
    # back (a counter reset after a gap, to Prometheus); its total is not moved to ~other.
    assert seen_unlisted == [3, 5, 9, 10, None, 5]
    assert value(scrape(unlisted), "askonce_ledger_arrivals_total", operation="~other",
                 kind="attributable") is None
    assert ledger.report(60.0).totals().arrivals == 5


def test_a_failing_report_keeps_the_counters_and_counts_the_failure() -> None:
    ledger = MemoryLedger()
    ledger.record(1.0, "op", key="k", edge=True)
    fail = False

    def report(now: float) -> Report:
        if fail:
            raise ConnectionError("redis away")
        return ledger.report(now)

    registry = CollectorRegistry()
    registry.register(LedgerCollector(report=report, clock=lambda: 1.0))
    assert value(scrape(registry), "askonce_ledger_arrivals_total", operation="op", kind="attributable") == 1
    fail = True
    s = scrape(registry)
    assert value(s, "askonce_ledger_arrivals_total", operation="op", kind="attributable") == 1
    assert value(s, "askonce_ledger_report_errors_total") == 1
    assert (value(s, "askonce_events_total", event="prometheus.report.error") or 0) >= 1


def operations_of(samples: Samples) -> set[str]:
    return {dict(labels)["operation"] for name, labels in samples
            if name == "askonce_ledger_arrivals_total"}


def test_unlisted_names_take_free_slots_and_leave_with_their_windows() -> None:
    ledger = MemoryLedger(LedgerPolicy(window=1.0, windows_kept=3))
    registry = CollectorRegistry()
    clock = Clock()
    registry.register(LedgerCollector(ledger, clock=clock, max_operations=3))
    found = []
    for t in range(6):  # a new operation name in every window: the ledger's own bound does not stop these
        ledger.record(float(t), f"op{t}", key="k", edge=True)
        clock.now = float(t)
        s = scrape(registry)
        found.append(operations_of(s))
    # op3 came while three names held the slots; op0 and op1 left the report with their windows
    assert found[3] == {"op0", "op1", "op2", "~other"}
    assert found[5] == {"op2", "op4", "op5", "~other"}
    assert value(s, "askonce_ledger_arrivals_total", operation="~other", kind="attributable") == 1


def test_listed_names_and_those_askonce_writes_are_the_only_labels() -> None:
    ledger = MemoryLedger(LedgerPolicy(window=10.0))
    registry = CollectorRegistry()
    register(ledger, registry, clock=Clock(1.0), operations=["GET /items/{id}"], layers=["gw"],
             origins=["api"], reasons=["buffer-full"])
    for op, layer, origin in [("GET /items/{id}", "gw", "api"), ("GET /evil", "evil", "evil"),
                              ("GET /items/{id}", "gw2", "~unsigned"), ("~unknown", "gw", None)]:
        ledger.record(1.0, op, key=f"k-{layer}", origin=origin, path=((layer, 2),))
    ledger.note_dropped(2, "buffer-full")
    ledger.note_dropped(3, "someone-elses")
    s = scrape(registry)
    assert operations_of(s) == {"GET /items/{id}", "~other", "~unknown"}
    retries = {tuple(dict(labels)[k] for k in ("operation", "layer")): v
               for (name, labels), v in s.items() if name == "askonce_ledger_retries_total"}
    assert retries == {("GET /items/{id}", "gw"): 1, ("GET /items/{id}", "~other"): 1,
                       ("~other", "~other"): 1, ("~unknown", "gw"): 1}
    reminted = {tuple(dict(labels)[k] for k in ("operation", "origin")): v
                for (name, labels), v in s.items() if name == "askonce_ledger_reminted_total"}
    assert reminted == {("GET /items/{id}", "api"): 1, ("GET /items/{id}", "~unsigned"): 1,
                        ("~other", "~other"): 1, ("~unknown", "~unknown"): 1}
    assert value(s, "askonce_ledger_dropped_total", reason="buffer-full") == 2
    assert value(s, "askonce_ledger_dropped_total", reason="~other") == 3


def test_event_names_keep_their_labels_once_given() -> None:
    registry = CollectorRegistry()
    registry.register(LedgerCollector(report=_report, max_events=2))
    for i in range(3):
        count(f"test.prometheus.event{i}")
    first = {dict(labels)["event"]: v for (name, labels), v in scrape(registry).items()
             if name == "askonce_events_total"}
    count("0.test.prometheus.sorts-first")  # a new name, sorted before every label given
    then = {dict(labels)["event"]: v for (name, labels), v in scrape(registry).items()
            if name == "askonce_events_total"}
    assert len(first) == 3 and set(then) == set(first)
    assert then["~other"] == first["~other"] + 1
    assert all(then[e] >= n for e, n in first.items())


def test_registering_reads_no_report_and_options_are_checked() -> None:
    def report(now: float) -> Report:
        raise AssertionError("describe() must not read a report")

    CollectorRegistry().register(LedgerCollector(report=report))
    with pytest.raises(ValueError):
        LedgerCollector()
    with pytest.raises(ValueError):
        LedgerCollector(MemoryLedger(), max_operations=0)
    with pytest.raises(ValueError):
        LedgerCollector(MemoryLedger(), prefix="9bad-name")
    with pytest.raises(ValueError):
        LedgerCollector(MemoryLedger(), max_names=0)


def _report(now: float) -> Any:
    return MemoryLedger(LedgerPolicy()).report(now)


MISCONFIGURED: list[Any] = [
    pytest.param(lambda: LedgerCollector(report=_report, prefix=5), id="prefix not a string"),  # type: ignore[arg-type]
    pytest.param(lambda: LedgerCollector(report=_report, prefix="d\u00e9j\u00e0"), id="prefix not ASCII"),
    pytest.param(lambda: LedgerCollector(object()), id="ledger without report"),  # type: ignore[arg-type]
    pytest.param(lambda: LedgerCollector(report=5), id="report not callable"),  # type: ignore[arg-type]
    pytest.param(lambda: LedgerCollector(report=_report, clock=5), id="clock not callable"),  # type: ignore[arg-type]
    pytest.param(lambda: LedgerCollector(report=_report, events="no"), id="events not a bool"),  # type: ignore[arg-type]
    pytest.param(lambda: LedgerCollector(report=_report, operations="GET /"), id="operations str"),
    pytest.param(lambda: LedgerCollector(report=_report, layers=5),  # type: ignore[arg-type]
                 id="layers not a list"),
    pytest.param(lambda: LedgerCollector(report=_report, origins=[b"o"]),  # type: ignore[list-item]
                 id="origins not str"),
]


@pytest.mark.parametrize("make", MISCONFIGURED)
def test_a_misconfiguration_is_refused_at_construction(make: Callable[[], object]) -> None:
    with pytest.raises(ValueError):
        make()


def test_a_prometheus_prefix_that_passes_is_a_valid_metric_name() -> None:
    registry = CollectorRegistry()
    registry.register(LedgerCollector(report=_report, prefix="svc_askonce2"))  # would raise if invalid


def test_served_over_http_by_prometheus_client() -> None:
    ledger = MemoryLedger()
    ledger.record(time.time(), "op", key="k", edge=True)
    registry = CollectorRegistry()
    register(ledger, registry)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        text = httpx.get(f"http://127.0.0.1:{server.server_port}/metrics", timeout=5).text
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    assert 'askonce_ledger_arrivals_total{kind="attributable",operation="op"} 1.0' in text
    assert "# TYPE askonce_ledger_amplification gauge" in text
    assert "askonce_events_total" in text and askonce.stats() is not None
