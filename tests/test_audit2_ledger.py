"""Audit 2, the ledger: absurd times and policies, a log line with a non-finite time, and a RedisLedger
whose Redis stays away for long."""

from __future__ import annotations

import time

import pytest

import askonce
from askonce.audit import LogFormat, audit_lines
from askonce.core.ledger import Ledger, LedgerPolicy
from askonce.ledger_store import MemoryLedger, RedisLedger
from redis_server import RedisServer, free_port

# --- the core ---------------------------------------------------------------------------------------------


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


def test_an_empty_ledger_reports_nothing_and_no_nan() -> None:
    for report in (Ledger().report(0.0), MemoryLedger().report(1e9)):
        assert report.operations == () and report.totals().amplification is None
        assert report.to_dict()["operations"] == []


# --- audit: one bad line is a bad line --------------------------------------------------------------------


@pytest.mark.parametrize("time_value", ["NaN", "Infinity", "-Infinity", '"nan"', '"inf"', "1e400", '"-1e999"'])
def test_a_log_line_with_a_non_finite_time_is_a_bad_line_not_the_end_of_the_audit(time_value: str) -> None:
    good = b'{"time": 1700000000, "operation": "get", "askonce_question": "v=1, k=abcdefghijklmnopqrstuv, e"}'
    bad = b'{"time": %s, "operation": "get"}' % time_value.encode()
    result = audit_lines([good, bad, good], LogFormat())
    assert result.lines == 3
    assert result.bad == {"time": 1}
    assert result.report.totals().arrivals == 2


def test_a_time_out_of_range_for_the_window_is_a_bad_line() -> None:
    line = b'1.2.3.4 - - [10/Oct/2000:13:55:36 -0700] "GET /a HTTP/1.1" 200 "v=1, k=abcdefghijklmnopqrstuv, e"'
    result = audit_lines([line, line], LogFormat(kind="nginx"), LedgerPolicy(window=0.001))
    assert result.report.totals().arrivals == 2
    far = b'{"time": "-1.7e308", "operation": "get"}'
    result = audit_lines([far], LogFormat(), LedgerPolicy(window=0.001))
    assert result.bad == {"time": 1}


# --- the Redis ledger while Redis is away -----------------------------------------------------------------


def test_a_long_outage_holds_a_bounded_number_of_calls_and_loses_no_drop_count(own_redis: RedisServer) -> None:
    ledger = RedisLedger(own_redis.url, start=False, max_buffer=2, retry_after=0.0, op_timeout=0.05,
                         read_timeout=0.2)
    try:
        own_redis.stop()
        for i in range(200):  # 200 flushes while Redis is away, each with arrivals dropped
            for j in range(3):
                ledger.record(time.time(), "op", key=f"k{i}-{j}", edge=True)
            ledger.flush()
        assert len(ledger._held) <= 4  # one held call per flush: memory grows for as long as Redis is away
        dropped = ledger.local_report(time.time()).dropped
        assert dropped == {"buffer-full": 3 * 200 - 2}
        own_redis.start()
        assert ledger.flush()
        assert ledger.flush()  # the drop counts held back
        report = ledger.report(time.time())
        assert report.dropped == {"buffer-full": 3 * 200 - 2}
        assert report.totals().arrivals == 2
    finally:
        ledger.close(timeout=1.0)


def test_a_capped_record_with_redis_frozen_is_bounded_and_falls_back(own_redis: RedisServer) -> None:
    ledger = RedisLedger(own_redis.url, policy=LedgerPolicy(cap=1), start=False, op_timeout=0.05,
                         read_timeout=0.2, retry_after=30.0)
    try:
        own_redis.pause()
        before = askonce.stats()
        started = time.monotonic()
        assert ledger.record(time.time(), "op", key="k", edge=True)
        assert not ledger.record(time.time(), "op", key="k", edge=True)  # the local cap decides
        assert time.monotonic() - started < 2.0  # bound: one op_timeout, then Redis is left alone
        assert askonce.stats().get("ledger.redis.cap-fallback", 0) - before.get("ledger.redis.cap-fallback", 0) == 2
        assert not ledger.flush()
        own_redis.resume()
    finally:
        ledger.close(timeout=1.0)


def test_a_redis_ledger_with_nowhere_to_connect_constructs_and_records() -> None:
    ledger = RedisLedger(f"redis://127.0.0.1:{free_port()}/0", start=False, policy=LedgerPolicy(cap=2),
                         retry_after=0.0)
    try:
        recorded = [ledger.record(time.time(), "op", key="k", edge=True) for _ in range(3)]
        assert recorded == [True, True, False]  # the local cap decides while Redis is unreachable
        assert not ledger.record(time.time(), "op", key="k", edge=True)
        assert ledger.local_report(time.time()).totals().refused == 2
        assert not ledger.flush()
    finally:
        ledger.close(timeout=0.5)


def test_a_time_too_far_for_the_window_is_one_invalid_arrival_not_a_lost_batch(shared_redis: RedisServer) -> None:
    prefix = f"a2-{time.monotonic_ns()}"
    ledger = RedisLedger(shared_redis.url, policy=LedgerPolicy(window=0.001, windows_kept=2), prefix=prefix,
                         start=False, local=False)
    try:
        now = time.time()
        ledger.record(now, "op", key="a", edge=True)
        ledger.record(1.7e308, "op", key="b", edge=True)  # finite, but no window of 1 ms holds it
        ledger.record(now, "op", key="c", edge=True)
        assert ledger.flush()
        report = ledger.report(now)
        assert report.totals().arrivals == 2
        assert report.dropped == {"invalid": 1}
    finally:
        ledger.close(timeout=1.0)
