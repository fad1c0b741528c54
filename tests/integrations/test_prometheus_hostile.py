"""The Prometheus collector under names a client chooses: bounded series and memory, counters that
never go down, and real routes that keep their labels through a flood."""

from __future__ import annotations

import os
import random
import time

import flask
import werkzeug.test
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from askonce.core.ledger import Ledger, LedgerPolicy
from askonce.core.naming import path_template
from askonce.core.question import Hop
from askonce.core.wire import QUESTION_HEADER, format_question, valid_name
from askonce.integrations.prometheus import LedgerCollector
from askonce.integrations.wsgi import AskonceWSGIMiddleware, route_operations
from askonce.ledger.store import MemoryLedger

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
ARRIVALS = "askonce_ledger_arrivals_total"


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def samples(collector: LedgerCollector) -> Samples:
    families: list[Metric] = list(collector.collect())
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


def exposed(registry: CollectorRegistry) -> Samples:
    """What Prometheus would read: the registry's text exposition, parsed."""
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def arrivals(s: Samples, operation: str, kind: str = "attributable") -> float | None:
    return s.get((ARRIVALS, (("kind", kind), ("operation", operation))))


def operations(s: Samples) -> set[str]:
    return {dict(labels)["operation"] for name, labels in s if name == ARRIVALS}


def resident() -> int | None:
    """This process's resident memory in bytes (Linux), else None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def never_down(before: Samples, after: Samples) -> list[str]:
    """Counters (``*_total``) present in both scrapes that went down."""
    return [f"{k}: {before[k]} -> {v}" for k, v in after.items()
            if k[0].endswith("_total") and k in before and v < before[k]]


def test_series_never_go_down_and_stay_within_the_bound_as_names_come_and_go() -> None:
    rng = random.Random(14)
    ledger = MemoryLedger(LedgerPolicy(window=1.0, windows_kept=2, max_operations=8, max_names=4))
    clock = Clock()
    ops = [f"GET /r{i}" for i in range(12)]
    layers = [f"l{i}" for i in range(6)]
    origins = [f"o{i}" for i in range(6)]
    unlisted = LedgerCollector(ledger, clock=clock, events=False, max_operations=3, max_names=2)
    listed = LedgerCollector(ledger, clock=clock, events=False, operations=ops[:4],
                             layers=layers[:2], origins=origins[:2], reasons=[])
    everything = LedgerCollector(ledger, clock=clock, events=False, operations=ops, layers=layers,
                                 origins=origins)
    previous: dict[int, Samples] = {}
    recorded = 0
    for window in range(80):
        busy = rng.random() < 0.7  # quiet windows let names leave the report
        for step in range(3):
            t = window + 0.1 + 0.4 * step
            for _ in range(rng.randrange(12) if busy else 0):
                path = tuple((rng.choice(layers), rng.randrange(1, 4))
                             for _ in range(rng.randrange(3)))
                edge = rng.random() < 0.5
                ledger.record(t, rng.choice(ops), key=f"k{rng.randrange(40)}", edge=edge, path=path,
                              origin=None if edge else rng.choice(origins))
                recorded += 1
            clock.now = t
            for c in (unlisted, listed, everything):
                s = samples(c)
                assert len(s) <= c.bound
                assert never_down(previous.get(id(c), {}), s) == []
                previous[id(c)] = s
            # every name on a list: nothing forgotten, the arrivals add up to what was recorded
            total = sum(v for (name, _), v in previous[id(everything)].items() if name == ARRIVALS)
            assert total == recorded
    assert operations(previous[id(listed)]) <= {*ops[:4], "~other"}
    assert len(operations(previous[id(unlisted)]) - {"~other"}) <= 3


def _word(i: int) -> str:
    """A distinct name a header can carry, and a path segment that stays itself in a template."""
    return f"z{i:x}"


ROUTE = "GET /items/<int:item_id>"
HOPS = 32  # the most an attempt path carries (wire.MAX_HOPS): 32 layer names in one header


def test_a_million_hostile_names_leave_series_and_memory_bounded_and_routes_labelled() -> None:
    # 30,000 arrivals, each with a new operation (its path), a new origin and a path of 32 new
    # layers: 1,020,000 names, fed window by window through the core ledger, one scrape a window.
    windows, per_window = 30, 1000
    assert valid_name(_word(windows * per_window * (HOPS + 2)))
    assert path_template("GET", "/za1") == "GET /za1"
    ledger = Ledger(LedgerPolicy(window=1.0, windows_kept=2))
    clock = Clock()
    listed = LedgerCollector(ledger, clock=clock, operations=[ROUTE], layers=["edge"],
                             origins=["api"])
    unlisted = LedgerCollector(ledger, clock=clock)
    real = 0
    rss: list[int | None] = []
    seen: dict[int, Samples] = {}
    most: dict[int, int] = {}
    for w in range(windows):
        if w == 10:  # the ledger and both collectors are warm: what they keep from now on
            rss.append(resident())
        t = float(w)
        for i in range(per_window):
            n = (w * per_window + i) * (HOPS + 2)
            if w >= 3 and i % 20 == 10:  # the flood came first; then the real route, among it
                ledger.record(t, ROUTE, key=f"q{w}-{i}", edge=True, path=(("edge", 1),))
                real += 1
            ledger.record(t, path_template("GET", f"/{_word(n)}"), key=f"k{n}", origin=_word(n + 1),
                          path=tuple((_word(n + 2 + h), 2) for h in range(HOPS)))
        clock.now = t + 0.5
        for c in (listed, unlisted):
            s = samples(c)
            assert never_down(seen.get(id(c), {}), s) == []
            seen[id(c)] = s
            most[id(c)] = max(most.get(id(c), 0), len(s))
    rss.append(resident())
    s = seen[id(listed)]
    assert arrivals(s, ROUTE) == real  # every arrival of the real route, under its own label
    assert operations(s) == {ROUTE, "~other"}
    assert arrivals(s, "~other", "reminted") == windows * per_window
    assert most[id(listed)] <= listed.bound == 369
    assert most[id(unlisted)] <= unlisted.bound == 3828
    if rss[0] is not None and rss[1] is not None:  # what is kept does not grow with the names
        assert rss[1] - rss[0] < 16_000_000, rss


def test_through_the_wsgi_middleware_hostile_headers_and_methods_fold_and_the_route_stays() -> None:
    app = flask.Flask("askonce-prometheus-test")

    @app.get("/items/<int:item_id>")
    def item(item_id: int) -> str:
        return "ok"

    ledger = MemoryLedger(LedgerPolicy(window=86_400.0))
    middleware = AskonceWSGIMiddleware(app.wsgi_app, layer="target", ledger=ledger)
    client = werkzeug.test.Client(middleware)
    assert ROUTE in route_operations(app)
    listed, unlisted = CollectorRegistry(), CollectorRegistry()
    collector = LedgerCollector(ledger, operations=route_operations(app), layers=["edge"],
                                origins=["api"])
    listed.register(collector)
    unlisted.register(LedgerCollector(ledger))
    real = 0
    for i in range(1500):
        if i % 10 == 0:
            header = format_question(f"edge-question-{i:06d}", "edge", True, 2, None,
                                     (Hop("edge", 1),))
            assert client.get(f"/items/{i}", headers={QUESTION_HEADER: header}).status_code == 200
            real += 1
        # a client's own method, origin and attempt path, all new
        hops = tuple(Hop(_word(4 * i + h), 2) for h in range(1, 4))
        header = format_question(f"hostile-key-{i:08d}", _word(4 * i), False, 2, None, hops)
        client.open(f"/{_word(i)}", method=f"X{_word(i)}".upper(),
                    headers={QUESTION_HEADER: header})
    recorded = {o.operation for o in ledger.report(time.time()).operations}
    # invented methods are one name (core.naming.method_name): they make no names of their own
    assert recorded == {ROUTE, "OTHER ~unmatched"}
    s = exposed(listed)
    assert arrivals(s, ROUTE) == real
    assert operations(s) == {ROUTE, "~other"}
    assert arrivals(s, "~other", "reminted") == 1500  # every hostile header was read, and folded
    origins = {dict(labels)["origin"] for name, labels in s
               if name == "askonce_ledger_reminted_total"}
    assert origins == {"~other"}
    assert len(s) <= collector.bound
    # Unlisted too: the flood's methods and paths are one operation name, the route keeps its own.
    s = exposed(unlisted)
    assert arrivals(s, ROUTE) == real
    assert operations(s) == {ROUTE, "OTHER ~unmatched"} and len(s) <= 3828
