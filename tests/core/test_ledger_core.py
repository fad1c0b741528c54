"""The target's ledger core: classification, amplification, windows, bounded memory and names, the cap, the
policy, the report and merging (the sketches on their own: ``test_sketch.py``)."""

from __future__ import annotations

import json
import math
import random
import tracemalloc
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from askonce.core.ledger import OTHER, Kind, Ledger, LedgerPolicy, OperationReport, Report
from askonce.core.ledger.sketch import Frequent, HyperLogLog, digest64
from askonce.core.ledger.state import HLL_PRECISION
from askonce.ledger.store import MemoryLedger
from ledger_memory import measure_bytes_per_key

Path = tuple[tuple[str, int], ...]

FIRST: Path = (("edge", 1), ("gw", 1), ("api", 1))


def only(report: Report, operation: str = "op") -> OperationReport:
    found = report.find(operation)
    assert found is not None, f"no figures for {operation!r}"
    return found


# Classification and the figures, table-driven -------------------------------------------------------


@dataclass(frozen=True)
class Arrival:
    key: str | None
    path: Path = FIRST
    edge: bool = True
    origin: str | None = None
    principal: str = ""
    malformed: bool = False


def feed(ledger: Ledger, arrivals: list[Arrival], now: float = 1.0, operation: str = "op") -> list[bool]:
    return [
        ledger.record(
            now, operation, key=a.key, edge=a.edge, origin=a.origin, path=a.path,
            principal=a.principal, malformed=a.malformed,
        )
        for a in arrivals
    ]  # fmt: skip


CASES: list[tuple[str, list[Arrival], dict[str, Any]]] = [
    (
        "honest: each key once",
        [Arrival(f"q{i}") for i in range(20)],
        {
            "amplification": 1.0,
            "coverage": 1.0,
            "distinct_keys": 20,
            "retries_by": {},
            "undeclared_retries": 0,
            "heavy": (),
        },
    ),
    (
        "one key, three attempts by gw",
        [Arrival("q", (("edge", 1), ("gw", n), ("api", 1))) for n in (1, 2, 3)],
        {"amplification": 3.0, "coverage": 1.0, "distinct_keys": 1, "retries_by": {"gw": 2}, "undeclared_retries": 0},
    ),
    (
        "retries at two layers each counted once per arrival",
        [
            Arrival("q", (("edge", 1), ("gw", 1))),
            Arrival("q", (("edge", 2), ("gw", 1))),
            Arrival("q", (("edge", 2), ("gw", 2))),
        ],
        {"amplification": 3.0, "retries_by": {"edge": 2, "gw": 1}},
    ),
    (
        "a layer's last hop decides: (gw 2, gw 1) is no retry by gw",
        [Arrival("q", (("gw", 2), ("gw", 1))), Arrival("r", (("gw", 1), ("gw", 3)))],
        {"retries_by": {"gw": 1}},
    ),
    (
        "same key, same path twice: one undeclared retry",
        [Arrival("q"), Arrival("q")],
        {"amplification": 2.0, "undeclared_retries": 1, "retries_by": {}},
    ),
    (
        "undeclared is arrivals minus distinct (key, path) pairs",
        [Arrival("q"), Arrival("q"), Arrival("q", (("gw", 2),)), Arrival("q", (("gw", 2),)), Arrival("r")],
        {"undeclared_retries": 2, "distinct_keys": 2, "amplification": 2.5},
    ),
    (
        "re-minted keys lower coverage and name the origin",
        [
            Arrival("q1"),
            Arrival("q2"),
            Arrival("m1", edge=False, origin="gw"),
            Arrival("m2", edge=False, origin="gw"),
            Arrival("m3", edge=False),
        ],
        {"coverage": 0.4, "distinct_keys": 2, "amplification": 1.0, "reminted_by": {"gw": 2, "~unknown": 1}},
    ),
    (
        "unkeyed and malformed are counted as such and never as keys",
        [Arrival(None), Arrival(None), Arrival(None, malformed=True), Arrival("q", malformed=True), Arrival("q")],
        {
            "arrivals": 5,
            "distinct_keys": 1,
            "coverage": 0.2,
            "amplification": 1.0,
            "kinds": {Kind.ATTRIBUTABLE: 1, Kind.REMINTED: 0, Kind.UNKEYED: 2, Kind.MALFORMED: 2},
        },
    ),
    (
        "only unkeyed: no amplification, zero coverage",
        [Arrival(None), Arrival(None)],
        {"amplification": None, "coverage": 0.0, "distinct_keys": 0},
    ),
    (
        "the same key under two principals is two questions",
        [Arrival("q", principal="a"), Arrival("q", principal="b")],
        {"distinct_keys": 2, "amplification": 1.0, "undeclared_retries": 0},
    ),
    (
        "heaviest keys, heaviest first, only keys seen more than once",
        [Arrival("h", (("gw", n),)) for n in range(1, 6)]
        + [Arrival("m", (("gw", n),)) for n in (1, 2)]
        + [Arrival("x")],
        {"heavy": (("h", 5), ("m", 2)), "distinct_keys": 3},
    ),
]


@pytest.mark.parametrize(("arrivals", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_figures(arrivals: list[Arrival], expected: dict[str, Any]) -> None:
    ledger = Ledger()
    assert all(feed(ledger, arrivals))
    got = only(ledger.report(1.0))
    assert got.arrivals == len(arrivals)
    for name, want in expected.items():
        value = getattr(got, name)
        if name == "heavy":
            value = tuple((h.key, h.arrivals) for h in value)
        assert value == want, name
    assert not got.approximate


def test_distribution_of_arrivals_per_key() -> None:
    ledger = Ledger()
    arrivals = [Arrival(f"q{i}") for i in range(98)] + [Arrival("a", (("gw", n),)) for n in range(1, 4)]
    arrivals += [Arrival("b", (("gw", n),)) for n in range(1, 11)]
    feed(ledger, arrivals)
    per_key = only(ledger.report(1.0)).per_key
    assert per_key.p50 == 1
    assert per_key.p99 == 3  # nearest rank: the 99th of 100 keys
    assert per_key.max == 10
    assert per_key.mean == pytest.approx(111 / 100)


# Honest traffic and a reference model, property-based -----------------------------------------------

layers = st.sampled_from(["edge", "gw", "api", "db"])
paths = st.lists(st.tuples(layers, st.integers(1, 4)), max_size=4).map(tuple)


@given(st.lists(paths, min_size=1, max_size=60), st.integers(1, 5))
def test_honest_traffic_is_amplification_one(path_list: list[Path], principals: int) -> None:
    ledger = Ledger()
    for i, path in enumerate(path_list):
        ledger.record(5.0, "op", key=f"q{i}", edge=True, path=path, principal=f"t{i % principals}")
    got = only(ledger.report(5.0))
    assert got.amplification == 1.0
    assert got.coverage == 1.0
    assert got.distinct_keys == len(path_list)
    assert got.undeclared_retries == 0
    assert got.per_key.p99 == 1


def reference_retries(path: Path) -> set[str]:
    last: dict[str, int] = {}
    for layer, attempt in path:
        last[layer] = attempt
    return {layer for layer, attempt in last.items() if attempt > 1}


arrival = st.builds(
    Arrival,
    key=st.one_of(st.none(), st.sampled_from([f"k{i}" for i in range(6)])),
    path=st.sampled_from([(), FIRST, (("gw", 2),), (("edge", 2), ("gw", 3)), (("gw", 3), ("gw", 1))]),
    edge=st.booleans(),
    origin=st.sampled_from([None, "gw", "api"]),
    principal=st.sampled_from(["", "t1"]),
    malformed=st.sampled_from([False, False, False, True]),
)


@given(st.lists(arrival, max_size=80))
def test_figures_match_a_reference_model(arrivals: list[Arrival]) -> None:
    ledger = Ledger()
    feed(ledger, arrivals)
    got = only(ledger.report(1.0)) if arrivals else None
    if got is None:
        assert ledger.report(1.0).operations == ()
        return
    keyed = [a for a in arrivals if a.key is not None and not a.malformed]
    attributable = [a for a in keyed if a.edge]
    distinct = {(a.principal, a.key) for a in attributable}
    pairs = {(a.edge, a.principal, a.key, a.path) for a in keyed}
    retries = Counter(layer for a in arrivals for layer in reference_retries(a.path))
    reminted = Counter(a.origin or "~unknown" for a in keyed if not a.edge)
    assert got.arrivals == len(arrivals)
    assert got.attributable == len(attributable)
    assert got.distinct_keys == len(distinct)
    assert got.amplification == (len(attributable) / len(distinct) if distinct else None)
    assert got.coverage == len(attributable) / len(arrivals)
    assert got.undeclared_retries == len(keyed) - len(pairs)
    assert dict(got.retries_by) == dict(retries)
    assert dict(got.reminted_by) == dict(reminted)
    assert got.kinds[Kind.MALFORMED] == sum(a.malformed for a in arrivals)
    assert got.kinds[Kind.UNKEYED] == sum(a.key is None and not a.malformed for a in arrivals)
    assert sum(got.kinds.values()) == got.arrivals
    assert got.paths_untracked == 0


def test_paths_beyond_the_tracked_few_are_never_called_undeclared() -> None:
    ledger = Ledger(LedgerPolicy(max_paths_per_key=2))
    for n in (1, 2, 3, 3, 4, 1):  # paths 3 and 4 arrive when two paths are already tracked
        ledger.record(1.0, "op", key="q", edge=True, path=(("gw", n),))
    got = only(ledger.report(1.0))
    assert got.paths_untracked == 3
    assert got.undeclared_retries == 1  # only the repeat of a tracked path (gw 1) is certain


# Windows -------------------------------------------------------------------------------------------


def test_windows_roll_and_only_windows_kept_are_reported() -> None:
    ledger = Ledger(LedgerPolicy(window=10.0, windows_kept=2))
    for w in range(6):
        for i in range(w + 1):
            ledger.record(w * 10.0 + 1.0, "op", key=f"w{w}-{i}", edge=True)
    report = ledger.report(55.0)
    assert [(o.start, o.end, o.arrivals, o.current) for o in report.operations] == [
        (30.0, 40.0, 4, False), (40.0, 50.0, 5, False), (50.0, 60.0, 6, True),
    ]  # fmt: skip
    assert only(report).arrivals == 6
    assert report.find("op", start=40.0) is not None
    assert report.find("op", start=20.0) is None


def test_a_gap_drops_windows_older_than_kept_and_report_rolls() -> None:
    ledger = Ledger(LedgerPolicy(window=1.0, windows_kept=3))
    ledger.record(0.5, "op", key="a", edge=True)
    ledger.record(2.5, "op", key="b", edge=True)
    assert [o.start for o in ledger.report(3.5).operations] == [0.0, 2.0]  # window 3 is empty
    assert [o.start for o in ledger.report(4.0).operations] == [2.0]  # window 0 is 4 windows old
    assert [o.start for o in ledger.report(5.9).operations] == [2.0]
    assert ledger.report(6.0).operations == ()


def test_late_arrival_counts_in_the_current_window() -> None:
    ledger = Ledger(LedgerPolicy(window=10.0))
    ledger.record(25.0, "op", key="a", edge=True)
    ledger.record(19.0, "op", key="a", edge=True)  # a clock slightly behind
    report = ledger.report(25.0)
    assert [(o.start, o.arrivals) for o in report.operations] == [(20.0, 2)]


def test_same_key_in_the_next_window_is_a_new_count() -> None:
    ledger = Ledger(LedgerPolicy(window=10.0))
    ledger.record(1.0, "op", key="a", edge=True)
    ledger.record(11.0, "op", key="a", edge=True)
    assert [o.amplification for o in ledger.report(11.0).operations] == [1.0, 1.0]


def test_time_must_be_finite() -> None:
    ledger = Ledger()
    for bad in (math.nan, math.inf):
        with pytest.raises(ValueError):
            ledger.record(bad, "op", key="a", edge=True)


def test_closed_window_figures_are_cached_but_merge_refreshes_them() -> None:
    a, b = Ledger(LedgerPolicy(window=10.0)), Ledger(LedgerPolicy(window=10.0))
    a.record(1.0, "op", key="q", edge=True)
    a.record(11.0, "op", key="r", edge=True)
    first = a.report(11.0).operations[0]
    assert a.report(11.0).operations[0] is first
    b.record(2.0, "op", key="q", edge=True, path=(("gw", 2),))
    a.merge(b)
    closed = a.report(11.0).find("op", start=0.0)
    assert closed is not None and closed is not first
    assert (closed.arrivals, closed.amplification, dict(closed.retries_by)) == (2, 2.0, {"gw": 1})


@pytest.mark.parametrize("now", [1.7e308, -1.7e308])
def test_a_time_too_far_for_its_window_is_a_value_error_not_an_overflow(now: float) -> None:
    ledger = Ledger(LedgerPolicy(window=0.001))
    with pytest.raises(ValueError):
        ledger.record(now, "op", key="k", edge=True)
    with pytest.raises(ValueError):
        ledger.report(now)
    assert ledger.record(1.0, "op", key="k", edge=True)  # and the ledger still works


def test_the_smallest_and_largest_windows_record_and_report() -> None:
    for window in (0.001, 366 * 86_400.0):
        ledger = MemoryLedger(LedgerPolicy(window=window))
        for t in (0.0, 1e9, 1e12, -5.0, 1e12 + 0.5):
            assert ledger.record(t, "op", key=f"k{t}", edge=True)
        assert ledger.report(1e12 + 0.5).totals().arrivals >= 1


def test_a_clock_going_backwards_counts_in_the_current_window() -> None:
    ledger = Ledger(LedgerPolicy(window=10.0))
    ledger.record(100.0, "op", key="a", edge=True)
    ledger.record(5.0, "op", key="a", edge=True)  # far back: still counted, now
    ledger.record(-1e9, "op", key="b", edge=True)
    report = ledger.report(100.0)
    assert [o.arrivals for o in report.operations] == [3]
    assert report.operations[0].start == 100.0


# Bounded memory: the exact table, then the sketches -------------------------------------------------


def test_overflow_is_approximate_and_hll_is_within_five_percent() -> None:
    ledger = Ledger(LedgerPolicy(max_exact_keys=1_000))
    for i in range(100_000):
        ledger.record(1.0, "op", key=f"key-{i}", edge=True, path=FIRST)
    got = only(ledger.report(1.0))
    assert got.approximate and ledger.report(1.0).approximate
    assert got.arrivals == got.attributable == 100_000
    assert abs(got.distinct_keys - 100_000) / 100_000 < 0.05
    assert got.amplification == pytest.approx(1.0, rel=0.05)
    assert got.cap_unenforced == 0  # no cap configured


def test_exact_figures_are_not_approximate_at_the_bound() -> None:
    ledger = Ledger(LedgerPolicy(max_exact_keys=100))
    for i in range(100):
        ledger.record(1.0, "op", key=f"k{i}", edge=True)
    assert not only(ledger.report(1.0)).approximate
    ledger.record(1.0, "op", key="one-more", edge=True)
    assert only(ledger.report(1.0)).approximate


def test_heavy_hitters_found_among_overflow_keys() -> None:
    ledger = Ledger(LedgerPolicy(max_exact_keys=500, heavy_keys=4))
    rng = random.Random(7)
    truth = {"hot-1": 3_000, "hot-2": 2_000, "hot-3": 1_000, "early": 400}
    for i in range(499):  # fill the exact table first, so that the hot keys are only in the sketch
        ledger.record(1.0, "op", key=f"warm-{i}", edge=True)
    ledger.record(1.0, "op", key="early", edge=True)
    stream = [f"cold-{i}" for i in range(50_000)] + [k for k, n in truth.items() for _ in range(n - (k == "early"))]
    rng.shuffle(stream)
    for i, key in enumerate(stream):
        ledger.record(1.0, "op", key=key, edge=True, path=(("gw", 1 + i % 8),))
    got = only(ledger.report(1.0))
    assert got.approximate
    assert [h.key for h in got.heavy] == ["hot-1", "hot-2", "hot-3", "early"]
    spilled = len(stream) - truth["early"] + 1
    for h in got.heavy:  # lower bounds, never more than the truth, and within the stated error
        assert h.arrivals <= truth[h.key] <= h.arrivals + h.error
        assert h.error <= spilled / (ledger._heavy_k + 1)
    assert got.heavy[-1].error == 0 and got.heavy[-1].arrivals == 400  # counted exactly
    assert got.per_key.max is not None and got.per_key.max <= 3_000


def test_a_million_distinct_keys_keep_the_exact_table_bounded() -> None:
    policy = LedgerPolicy(max_exact_keys=2_000)
    ledger = Ledger(policy)
    for i in range(1_000_000):
        ledger.record(1.0, "op", key=f"k{i}", edge=True, path=(("gw", 1 + i % 3),))
    window = ledger._current
    assert window is not None
    op = window.ops["op"]
    assert sum(len(keys) for keys in op.attr.values()) == op.exact == policy.max_exact_keys
    assert op.heavy is not None and len(op.heavy.counts) <= ledger._heavy_k
    assert abs(only(ledger.report(1.0)).distinct_keys - 1_000_000) < 50_000


def test_traced_memory_stops_growing_past_the_exact_bound() -> None:
    ledger = Ledger(LedgerPolicy(max_exact_keys=2_000))
    tracemalloc.start()
    try:
        for i in range(20_000):
            ledger.record(1.0, "op", key=f"k{i}", edge=True, path=(("gw", 1 + i % 3),))
        at_20k = tracemalloc.get_traced_memory()[0]
        for i in range(20_000, 120_000):
            ledger.record(1.0, "op", key=f"k{i}", edge=True, path=(("gw", 1 + i % 3),))
        at_120k = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert at_20k < 1_000_000  # 2,000 exact keys, 16 KiB of registers, the heavy-key summary
    assert at_120k - at_20k < 20_000  # 100,000 more distinct keys cost (next to) nothing


def test_path_cache_is_bounded() -> None:
    ledger = Ledger()
    for i in range(10_000):
        ledger.record(1.0, "op", key=f"k{i}", edge=True, path=(("gw", 1), (f"layer{i}", 1)))
    assert len(ledger._paths) <= 4096
    assert only(ledger.report(1.0)).undeclared_retries == 0


def test_bytes_per_key_is_small() -> None:
    assert measure_bytes_per_key(20_000, with_keys=False) < 100
    assert measure_bytes_per_key(20_000) < 200


# Names are bounded ---------------------------------------------------------------------------------


def test_operations_beyond_the_limit_fold_into_other() -> None:
    ledger = Ledger(LedgerPolicy(max_operations=3))
    for i in range(10):
        ledger.record(1.0, f"op{i}", key=f"k{i}", edge=True)
    report = ledger.report(1.0)
    assert [o.operation for o in report.operations] == ["op0", "op1", "op2", OTHER]
    assert only(report, OTHER).arrivals == 7
    assert report.totals().arrivals == 10
    ledger.record(61.0, "op9", key="k", edge=True)  # a new window has room for new names
    assert [o.operation for o in ledger.report(61.0).operations if o.current] == ["op9"]


def test_layer_and_origin_names_are_bounded() -> None:
    ledger = Ledger(LedgerPolicy(max_names=2))
    for i in range(5):
        ledger.record(1.0, "op", key=f"k{i}", edge=False, origin=f"layer{i}", path=((f"layer{i}", 2),))
    got = only(ledger.report(1.0))
    assert dict(got.reminted_by) == {"layer0": 1, "layer1": 1, OTHER: 3}
    assert dict(got.retries_by) == {"layer0": 1, "layer1": 1, OTHER: 3}


def test_dropped_arrivals_are_shown() -> None:
    ledger = Ledger(LedgerPolicy(max_names=1))
    ledger.note_dropped(3, "buffer full")
    ledger.note_dropped(0, "nothing")
    ledger.note_dropped(2, "redis down")
    ledger.note_dropped(1, "buffer full")
    report = ledger.report(1.0)
    assert dict(report.dropped) == {"buffer full": 4, OTHER: 2}
    assert report.totals().dropped == 6
    with pytest.raises(ValueError):
        ledger.note_dropped(-1, "x")


def test_many_distinct_hostile_names_stay_bounded_and_counted() -> None:
    policy = LedgerPolicy(max_operations=8, max_exact_keys=100, max_names=4, cap=1)
    ledger = Ledger(policy)
    n = 5000
    for i in range(n):
        big = "\u00e9\U0001f600" * 50 + str(i)
        ledger.record(1.0, f"op-{big}", key=f"k{big}", edge=i % 2 == 0, origin=f"o{i}", principal=f"p{i}",
                      path=((f"layer{i}", 2), ("\ud800", 3)))
    report = ledger.report(1.0)
    assert len(report.operations) == 9  # 8 names and ~other
    totals = report.totals()
    assert totals.arrivals == n
    assert len(totals.reminted_by) <= 9 * 5 and all(len(o.retries_by) <= 5 for o in report.operations)
    assert sum(len(k) for op in ledger._ops.values() for t in (op.attr, op.remint) for k in t.values()) <= 9 * 100


# The cap -------------------------------------------------------------------------------------------


def test_cap_refuses_the_fourth_arrival_only_for_that_principal_and_window() -> None:
    ledger = Ledger(LedgerPolicy(window=10.0, cap=3))
    admitted = [ledger.record(1.0, "op", key="q", edge=True, principal="a", path=(("gw", n),)) for n in range(1, 6)]
    assert admitted == [True, True, True, False, False]
    assert ledger.record(1.0, "op", key="q", edge=True, principal="b")  # another tenant, same key
    assert ledger.record(1.0, "other-op", key="q", edge=True, principal="a")  # another operation
    assert ledger.record(1.0, "op", key="q", edge=False, origin="gw", principal="a")  # a re-minted twin
    got = only(ledger.report(1.0))
    assert got.refused == 2
    assert got.arrivals == 7 and got.amplification == 6 / 2  # refused arrivals still count
    assert ledger.record(11.0, "op", key="q", edge=True, principal="a")  # the next window starts afresh


def test_cap_never_refuses_unkeyed_or_malformed() -> None:
    ledger = Ledger(LedgerPolicy(cap=1))
    assert all(ledger.record(1.0, "op", key=None) for _ in range(10))
    assert all(ledger.record(1.0, "op", key="q", malformed=True) for _ in range(10))
    assert only(ledger.report(1.0)).refused == 0


def test_cap_applies_to_reminted_keys() -> None:
    ledger = Ledger(LedgerPolicy(cap=2))
    assert [ledger.record(1.0, "op", key="m", origin="gw") for _ in range(3)] == [True, True, False]


def test_cap_is_not_enforced_on_overflow_keys_and_says_so() -> None:
    ledger = Ledger(LedgerPolicy(cap=1, max_exact_keys=1))
    assert ledger.record(1.0, "op", key="tracked", edge=True)
    assert not ledger.record(1.0, "op", key="tracked", edge=True)
    assert all(ledger.record(1.0, "op", key="spilled", edge=True) for _ in range(4))
    got = only(ledger.report(1.0))
    assert got.refused == 1 and got.cap_unenforced == 4 and got.approximate


# Policy --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"window": 0.0}, {"window": -1.0}, {"window": math.inf}, {"window": math.nan}, {"window": True},
        {"windows_kept": -1}, {"max_exact_keys": -1}, {"max_exact_keys": 1.5}, {"heavy_keys": -1},
        {"max_operations": 0}, {"cap": 0}, {"cap": True}, {"max_paths_per_key": 0}, {"max_names": 0},
    ],
)  # fmt: skip
def test_policy_rejects_nonsense(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        LedgerPolicy(**kwargs)


def test_policy_accepts_edges() -> None:
    LedgerPolicy(window=0.001, windows_kept=0, max_exact_keys=0, heavy_keys=0, max_operations=1, cap=1)


def test_zero_exact_keys_is_all_sketch() -> None:
    ledger = Ledger(LedgerPolicy(max_exact_keys=0))
    for i in range(100):
        ledger.record(1.0, "op", key=f"k{i % 50}", edge=True)
    got = only(ledger.report(1.0))
    assert got.approximate and got.distinct_keys == 50 and got.per_key.p50 is None


@pytest.mark.parametrize("policy", [
    dict(window=1e-300),  # every record: OverflowError (now / window is inf)
    dict(window=1e-9),
    dict(window=1e300),  # a RedisLedger's TTL overflows Redis: every flush fails
    dict(window=True),
    dict(windows_kept=10**12),  # a RedisLedger report asks Redis for 10**12 windows
])
def test_an_absurd_ledger_policy_is_refused(policy: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        LedgerPolicy(**policy)  # type: ignore[arg-type]


# The report ----------------------------------------------------------------------------------------


def test_report_is_json_ready() -> None:
    ledger = Ledger(LedgerPolicy(max_exact_keys=3, cap=5))
    feed(ledger, CASES[6][1] + CASES[7][1] + CASES[10][1])
    ledger.note_dropped(2, "queue")
    report = ledger.report(1.0)
    text = json.dumps(report.to_dict())
    back = json.loads(text)
    assert back["operations"][0]["kinds"]["attributable"] == only(report).attributable
    assert back["dropped"] == {"queue": 2}
    assert json.loads(json.dumps(report.totals().to_dict()))["dropped"] == 2


def test_totals_sum_operations_and_windows() -> None:
    ledger = Ledger(LedgerPolicy(window=10.0))
    feed(ledger, [Arrival("a"), Arrival("a", (("gw", 2),))], now=1.0, operation="x")
    feed(ledger, [Arrival("b"), Arrival(None), Arrival("m", edge=False, origin="gw")], now=1.0, operation="y")
    feed(ledger, [Arrival("c")], now=12.0, operation="x")
    report = ledger.report(12.0)
    total = report.totals()
    assert (total.arrivals, total.attributable, total.distinct_keys) == (6, 4, 3)
    assert total.amplification == 4 / 3 and total.coverage == 4 / 6
    assert dict(total.retries_by) == {"gw": 1} and dict(total.reminted_by) == {"gw": 1}
    assert total.kinds[Kind.UNKEYED] == 1
    assert report.totals(start=10.0).arrivals == 1


def test_an_empty_ledger_reports_nothing_and_no_nan() -> None:
    for report in (Ledger().report(0.0), MemoryLedger().report(1e9)):
        assert report.operations == () and report.totals().amplification is None
        assert report.to_dict()["operations"] == []


# Merging replicas ----------------------------------------------------------------------------------

stream_item = st.tuples(
    st.integers(0, 299).map(float),
    st.sampled_from(["get", "put"]),
    arrival,
    st.booleans(),  # which replica sees it
)


def _replay(ledger: Ledger, items: list[tuple[float, str, Arrival]]) -> None:
    for now, operation, a in items:
        ledger.record(
            now, operation, key=a.key, edge=a.edge, origin=a.origin, path=a.path,
            principal=a.principal, malformed=a.malformed,
        )  # fmt: skip


def _check_merge_equals_one(stream: list[tuple[float, str, Arrival, bool]], dropped: tuple[int, int]) -> None:
    policy = LedgerPolicy(window=60.0, windows_kept=2, heavy_keys=3)
    stream = sorted(stream, key=lambda s: s[0])
    one, a, b = Ledger(policy), Ledger(policy), Ledger(policy)
    _replay(one, [(t, op, arr) for t, op, arr, _ in stream])
    _replay(a, [(t, op, arr) for t, op, arr, left in stream if left])
    _replay(b, [(t, op, arr) for t, op, arr, left in stream if not left])
    for ledger, n in ((one, sum(dropped)), (a, dropped[0]), (b, dropped[1])):
        if n:
            ledger.note_dropped(n, "buffer")
    now = 299.5
    b_before = b.report(now)
    a.merge(b)
    assert a.report(now) == one.report(now)
    assert a.report(now).totals() == one.report(now).totals()
    assert b.report(now) == b_before  # merging left the other replica alone


@settings(
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
    max_examples=150,
)
@given(st.lists(stream_item, min_size=20, max_size=200), st.integers(0, 3), st.integers(0, 3))
def test_two_replicas_merged_equal_one_ledger_fed_everything(
    stream: list[tuple[float, str, Arrival, bool]], dropped_a: int, dropped_b: int
) -> None:
    _check_merge_equals_one(stream, (dropped_a, dropped_b))


@pytest.mark.parametrize("seed", range(4))
def test_merge_equals_one_ledger_on_a_long_random_stream(seed: int) -> None:
    rng = random.Random(seed)
    paths = [(), FIRST, (("gw", 2),), (("edge", 2), ("gw", 3)), (("gw", 3), ("gw", 1))]
    stream = [
        (
            float(rng.randrange(300)),
            rng.choice(["get", "put"]),
            Arrival(
                key=rng.choice([None, *(f"k{i}" for i in range(40))]), path=rng.choice(paths),
                edge=rng.random() < 0.8, origin=rng.choice([None, "gw"]), principal=rng.choice(["", "t"]),
                malformed=rng.random() < 0.05,
            ),
            rng.random() < 0.5,
        )
        for _ in range(3_000)
    ]  # fmt: skip
    _check_merge_equals_one(stream, (1, 2))


def test_merge_keeps_the_newest_windows_whichever_side_has_them() -> None:
    policy = LedgerPolicy(window=10.0, windows_kept=1)
    old, new = Ledger(policy), Ledger(policy)
    old.record(1.0, "op", key="a", edge=True)
    old.record(11.0, "op", key="b", edge=True)
    new.record(25.0, "op", key="c", edge=True)
    old.merge(new)
    assert [(o.start, o.current) for o in old.report(25.0).operations] == [(10.0, False), (20.0, True)]


def test_merge_of_overflowed_replicas_merges_sketches() -> None:
    policy = LedgerPolicy(max_exact_keys=100)
    a, b = Ledger(policy), Ledger(policy)
    for i in range(30_000):
        (a if i % 2 else b).record(1.0, "op", key=f"k{i}", edge=True)
        a.record(1.0, "op", key="hot", edge=True, path=(("gw", 1 + i % 4),))
    a.merge(b)
    got = only(a.report(1.0))
    assert got.approximate and got.arrivals == 60_000
    assert abs(got.distinct_keys - 30_001) / 30_001 < 0.05
    assert got.heavy[0].key == "hot" and got.heavy[0].arrivals == 30_000  # tracked exactly from the start


def test_merge_rejects_other_policies_and_itself() -> None:
    a = Ledger()
    with pytest.raises(ValueError):
        a.merge(Ledger(LedgerPolicy(window=1.0)))
    with pytest.raises(ValueError):
        a.merge(a)


def test_merge_folds_operations_beyond_the_limit() -> None:
    policy = LedgerPolicy(max_operations=2)
    a, b = Ledger(policy), Ledger(policy)
    a.record(1.0, "x", key="1", edge=True)
    a.record(1.0, "y", key="2", edge=True)
    b.record(1.0, "z", key="3", edge=True)
    a.merge(b)
    assert [o.operation for o in a.report(1.0).operations] == ["x", "y", OTHER]


def test_the_sketches_hold_what_one_add_per_spilled_arrival_in_order_holds() -> None:
    # Past the exact bound arrivals reach the sketches a batch at a time; read between batches or
    # after, they hold what adding each attributable arrival at once would have.
    ledger = Ledger(LedgerPolicy(max_exact_keys=50, heavy_keys=1))
    for i in range(50):
        ledger.record(1.0, "op", key=f"fill-{i}", edge=True)
    hll, heavy = HyperLogLog(HLL_PRECISION), Frequent[tuple[str, str]](ledger._heavy_k)
    rng = random.Random(5)
    for i in range(6_000):
        principal, key, edge = rng.choice(["", "t1"]), f"k{rng.randrange(1_500)}", i % 5 != 0
        ledger.record(1.0, "op", key=key, edge=edge, principal=principal)
        if edge:
            hll.add_hash(digest64(principal, key))
            heavy.add((principal, key))
        if i % 777 == 0:
            ledger.report(1.0)
    op = ledger._ops["op"]
    assert op.hll is not None and op.heavy is not None and heavy.offset > 0
    assert op.hll._registers == hll._registers
    assert (op.heavy.counts, op.heavy.offset) == (heavy.counts, heavy.offset)


def test_work_started_per_question_sits_beside_arrivals_per_question() -> None:
    ledger = Ledger(LedgerPolicy(window=10.0))
    for key, n in (("a", 4), ("b", 1), ("c", 2)):  # 7 arrivals of 3 questions
        for _ in range(n):
            ledger.record(1.0, "op", key=key, edge=True)
    for _ in range(3):  # a's repeats waited for its run; c's repeat was its own run (a retry)
        ledger.joined(2.0, "op", edge=True)
    ledger.joined(2.0, "op", edge=False)  # an unattributable arrival is in neither figure
    op = only(ledger.report(3.0))
    assert (op.amplification, op.joined, op.work_per_question) == (7 / 3, 3, 4 / 3)
    totals = ledger.report(3.0).totals()
    assert (totals.joined, totals.work_per_question) == (3, 4 / 3)
    # Another replica's joins add up; a join answered in the next window never makes work negative.
    other = Ledger(LedgerPolicy(window=10.0))
    other.record(1.0, "op", key="a", edge=True)
    other.joined(1.5, "op", edge=True)
    ledger.merge(other)
    assert only(ledger.report(3.0)).joined == 4
    ledger.joined(12.0, "op", edge=True)
    late = ledger.report(12.0).find("op", start=10.0)
    assert late is not None and late.joined == 0 and late.work_per_question is None
    # Without joins, work per question is amplification.
    plain = Ledger(LedgerPolicy(window=10.0))
    plain.record(1.0, "op", key="x", edge=True)
    plain.record(1.0, "op", key="x", edge=True)
    assert only(plain.report(2.0)).work_per_question == only(plain.report(2.0)).amplification == 2.0


def test_a_join_counts_in_the_window_of_its_arrival_after_that_window_closed() -> None:
    ledger = Ledger(LedgerPolicy(window=10.0, windows_kept=2))
    ledger.record(9.0, "op", key="q", edge=True)  # the run
    ledger.record(9.5, "op", key="q", edge=True)  # a repeat that waits past the window's end
    ledger.record(10.5, "op", key="q", edge=True)  # another repeat, in the next window
    ledger.joined(10.5, "op", edge=True)
    ledger.joined(9.5, "op", edge=True)  # answered at 11.0, told at its arrival's time
    report = ledger.report(11.0)
    first, second = report.find("op", start=0.0), report.find("op", start=10.0)
    assert first is not None
    assert (first.arrivals, first.joined, first.work_per_question) == (2, 1, 1)
    assert second is not None and (second.joined, second.work_per_question) == (1, 0)
    # A window without the operation: its arrival was recorded late, in the window then current.
    ledger.record(9.9, "late", key="r", edge=True)
    ledger.joined(9.9, "late", edge=True)
    late = ledger.report(11.0).find("late", start=10.0)
    assert late is not None and (late.arrivals, late.joined) == (1, 1)
    assert ledger.report(11.0).find("late", start=0.0) is None
    ledger.joined(-30.0, "op", edge=True)  # before the kept windows: its arrival is gone too
    assert sum(o.joined for o in ledger.report(11.0).operations if o.operation == "op") == 2
