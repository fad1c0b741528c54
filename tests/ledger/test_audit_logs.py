"""Auditing access logs (``askonce.ledger.audit``): the ledger a live target would have kept, read from JSON lines,
nginx and envoy-style lines; bad lines are counted, never fatal, and memory stays flat (the command itself:
``test_ledger_cli.py``)."""

from __future__ import annotations

import gzip
import time
import tracemalloc
from pathlib import Path

import pytest

from access_logs import POLICY, T0, header, jsonl, key, live, nginx, traffic
from askonce.core.ledger import Kind, LedgerPolicy
from askonce.core.signing import sign_header
from askonce.ledger.audit import MAX_LINE, LogFormat, audit_file, audit_lines

# --- the same report as a live target --------------------------------------------------------------------


def test_a_jsonl_audit_reports_what_the_live_ledger_reports(tmp_path: Path) -> None:
    items = traffic(1, 3_000)
    log = tmp_path / "access.jsonl.gz"
    with gzip.open(log, "wb") as f:
        f.writelines(jsonl(items))
    result = audit_file(str(log), policy=POLICY)
    assert result.report == live(items).report(items[-1][0])
    assert result.lines == len(items) and not result.bad
    totals = result.report.totals()
    assert totals.undeclared_retries > 0 and dict(totals.retries_by)["gw"] > 0
    assert dict(totals.reminted_by) == {"mid": totals.kinds[Kind.REMINTED]} and totals.kinds[Kind.MALFORMED] > 0


def test_an_honest_log_reads_amplification_one_and_full_coverage() -> None:
    lines = jsonl([(T0 + i, "GET /x", header(key(i), (("edge", 1), ("gw", 1))), "") for i in range(500)])
    got = audit_lines(lines, policy=POLICY).report.totals()
    assert (got.amplification, got.coverage, got.undeclared_retries, dict(got.retries_by)) == (1.0, 1.0, 0, {})


@pytest.mark.parametrize("escape", ["default", "json"])
def test_nginx_lines_with_escaped_headers(escape: str) -> None:
    lines = [nginx(T0, "GET /items/42?x=1 HTTP/1.1", header(key(1), (("edge", 1), ("gw", 1))), escape),
             nginx(T0 + 1, "GET /items/43 HTTP/1.1", header(key(1), (("edge", 1), ("gw", 2))), escape),
             nginx(T0 + 2, "GET /items/44 HTTP/1.1", header(key(2)), escape),
             nginx(T0 + 2, "GET /items/44 HTTP/1.1", header(key(2)), escape),
             nginx(T0 + 3, "POST /orders HTTP/2.0", None, escape)]
    result = audit_lines(lines, LogFormat(kind="nginx"), POLICY)
    items = result.report.find("GET /items/{id}")
    assert items is not None and not result.bad
    assert (items.arrivals, items.distinct_keys, items.undeclared_retries, dict(items.retries_by)) == (4, 2, 1,
                                                                                                       {"gw": 1})
    orders = result.report.find("POST /orders")
    assert orders is not None and orders.coverage == 0.0 and orders.arrivals == 1


def test_envoy_style_lines_a_chosen_field_and_a_regex() -> None:
    h = header(key(7))
    quoted = h.replace('"', '\\"')
    envoy = f'[2023-11-14T22:13:20.310Z] "GET /v1/things/abc HTTP/1.1" 200 - 0 12 3 "{quoted}" "tenant-9"\n'
    by_field = audit_lines([envoy.encode()], LogFormat(kind="nginx", field=8, principal_index=9), POLICY)
    got = by_field.report.find("GET /v1/things/abc")
    assert got is not None and got.attributable == 1 and got.heavy == ()
    assert by_field.first == pytest.approx(1_700_000_000.31)
    regex = r'^(?P<time>\S+) (?P<method>[A-Z]+) (?P<path>\S+) q=(?P<question>.*)$'
    line = f"{T0} GET /a/123 q={h}\n".encode()
    by_regex = audit_lines([line, b"no match here\n"], LogFormat(kind="nginx", regex=regex), POLICY)
    assert by_regex.report.find("GET /a/{id}") is not None and by_regex.bad == {"regex": 1}


def test_signed_edge_keys_only_with_a_secret(tmp_path: Path) -> None:
    secret = "a signing secret of some length"
    lines = jsonl([(T0, "op", sign_header(header(key(1)), secret), ""), (T0, "op", header(key(2)), "")])
    assert audit_lines(lines, policy=POLICY).report.totals().coverage == 1.0
    assert audit_lines(lines, policy=POLICY, secret=secret).report.totals().coverage == 0.5


# --- bad input: counted, never fatal, never unbounded ----------------------------------------------------


def test_bad_lines_are_counted_and_shown_never_fatal(tmp_path: Path) -> None:
    good = jsonl([(T0, "op", header(key(1)), "")])[0]
    log = tmp_path / "mixed.log"
    log.write_bytes(good + b"not json\n" + b"[1, 2]\n" + b'{"operation": "op"}\n' + b'{"time": "yesterday"}\n'
                    + b"\xff\xfe\x00 binary\n" + b"\n" + b'{"time": 1, "askonce_question": 5}\n'
                    + b"x" * (MAX_LINE + 10) + b"\n" + good)
    result = audit_file(str(log), policy=POLICY)
    assert result.bad == {"json": 3, "time": 2, "too-long": 1}
    assert result.lines == 9  # the blank line is neither an arrival nor an error
    assert dict(result.report.dropped) == {"bad line: json": 3, "bad line: time": 2, "bad line: too-long": 1}
    assert result.report.totals().arrivals == 3  # two good lines and one malformed header


def test_memory_stays_flat_on_a_file_much_larger_than_the_ledger(tmp_path: Path) -> None:
    log = tmp_path / "big.jsonl"
    with open(log, "wb") as f:
        for start in range(0, 40_000, 10_000):
            f.writelines(jsonl([(T0 + i * 0.001, "op", header(key(i)), "") for i in range(start, start + 10_000)]))
    size = log.stat().st_size
    tracemalloc.start()
    try:
        result = audit_file(str(log), policy=LedgerPolicy(window=3600.0, max_exact_keys=2_000), engine="python")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert result.report.totals().arrivals == 40_000 and result.report.approximate
    assert size > 6_000_000 and peak < 1_000_000  # the file is read a line at a time


def test_format_options_are_checked() -> None:
    for bad in ({"kind": "csv"}, {"field": 0}, {"regex": "("}, {"regex": "(?P<question>.*)"}):
        with pytest.raises(ValueError):
            LogFormat(**bad)  # type: ignore[arg-type]


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


def test_a_proxys_log_counts_each_upstream_try_with_upstream() -> None:
    def line(t: float, h: str, tries: str) -> bytes:
        stamp = time.strftime("%d/%b/%Y:%H:%M:%S +0000", time.gmtime(t))
        escaped = h.replace('"', "\\x22")
        return f'10.0.0.1 [{stamp}] "GET /orders HTTP/1.1" 200 "{escaped}" "{tries}"\n'.encode()

    no_time = f'"GET /orders HTTP/1.1" "{header(key(9))}" "504, 504, 504"\n'.encode()
    lines = [line(T0, header(key(1)), "504, 200"), line(T0, header(key(2)), "200"),
             line(T0, header(key(3)), "502, 504 : 200"), no_time,
             line(T0, header(key(4)), "-"), line(T0 + 1, header(key(5)), "200"),
             line(T0 + 1, "-", "502, 502, 200")]  # an unkeyed request tried three times
    counted = audit_lines(lines, LogFormat(kind="nginx", upstream=True)).report.totals()
    assert counted.arrivals == 2 + 1 + 3 + 1 + 1 + 3  # the bad line's list counts for no other
    assert counted.undeclared_retries == 1 + 2 and counted.distinct_keys == 5
    plain = audit_lines(lines, LogFormat(kind="nginx")).report.totals()
    assert plain.arrivals == 6 and plain.undeclared_retries == 0
