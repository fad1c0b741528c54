"""``askonce audit`` (the ledger from access logs) and ``askonce report`` (the ledger from Redis or a URL)."""

from __future__ import annotations

import gzip
import json
import random
import subprocess
import sys
import threading
import time
import tracemalloc
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn

from askonce.audit import MAX_LINE, LogFormat, audit_file, audit_lines
from askonce.core import wire
from askonce.core.ledger import Kind, Ledger, LedgerPolicy
from askonce.core.question import Hop
from askonce.ledger_cli import main
from askonce.ledger_store import MemoryLedger, RedisLedger
from askonce.report_app import ReportApp
from askonce.signing import sign_header
from redis_server import RedisServer

T0 = 1_700_000_000.0
POLICY = LedgerPolicy(window=60.0, windows_kept=10)


def header(key: str, path: tuple[tuple[str, int], ...] = (("edge", 1),), edge: bool = True,
           origin: str = "edge") -> str:
    return wire.format_question(key, origin, edge, 2, 1.5, tuple(Hop(*h) for h in path))


def key(i: int) -> str:
    return f"question-{i:08d}-xyz"


def traffic(seed: int, n: int) -> list[tuple[float, str, str | None, str]]:
    """(time, operation, header or None, principal): a stack with one retrying hop, a re-minting one, junk."""
    rng = random.Random(seed)
    out: list[tuple[float, str, str | None, str]] = []
    for i in range(n):
        t = T0 + i * 0.1
        op = rng.choice(["GET /items/{id}", "POST /orders"])
        roll = rng.random()
        if roll < 0.7:
            for attempt in range(1, rng.choice([1, 1, 1, 2, 3]) + 1):
                out.append((t, op, header(key(i), (("edge", 1), ("gw", attempt))), rng.choice(["", "t1"])))
        elif roll < 0.8:
            out.append((t, op, header(key(i)), ""))
            out.append((t, op, header(key(i)), ""))  # a hop that retried without saying so
        elif roll < 0.9:
            out.append((t, op, header(f"local-{i:08d}-abcdef", edge=False, origin="mid"), ""))
        elif roll < 0.97:
            out.append((t, op, None, ""))
        else:
            out.append((t, op, "v=1, k=oops", ""))
    return out


def live(items: list[tuple[float, str, str | None, str]]) -> Ledger:
    """What a live target running the ledger would have counted for the same arrivals."""
    ledger = Ledger(POLICY)
    for t, op, h, principal in items:
        q = None if h is None else wire.parse_question(h, 0.0)
        if q is None:
            ledger.record(t, op, key=None, principal=principal)
        elif isinstance(q, wire.Malformed):
            ledger.record(t, op, key=None, principal=principal, malformed=True)
        else:
            ledger.record(t, op, key=q.key, edge=q.edge, origin=q.origin, path=q.path, principal=principal)
    return ledger


def jsonl(items: list[tuple[float, str, str | None, str]]) -> list[bytes]:
    return [json.dumps({"time": t, "operation": op, "askonce_question": h, "principal": p}).encode() + b"\n"
            for t, op, h, p in items]


def nginx(t: float, request: str, h: str | None, escape: str = "default") -> bytes:
    stamp = time.strftime("%d/%b/%Y:%H:%M:%S +0000", time.gmtime(t))
    value = "-" if h is None else h.replace('"', "\\x22" if escape == "default" else '\\"')
    return f'10.0.0.1 - - [{stamp}] "{request}" 200 5 "-" "curl/8.0" "{value}"\n'.encode()


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
        result = audit_file(str(log), policy=LedgerPolicy(window=3600.0, max_exact_keys=2_000))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert result.report.totals().arrivals == 40_000 and result.report.approximate
    assert size > 6_000_000 and peak < 1_000_000  # the file is read a line at a time


def test_format_options_are_checked() -> None:
    for bad in ({"kind": "csv"}, {"field": 0}, {"regex": "("}, {"regex": "(?P<question>.*)"}):
        with pytest.raises(ValueError):
            LogFormat(**bad)  # type: ignore[arg-type]


# --- the commands ----------------------------------------------------------------------------------------


def test_audit_command_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    items = traffic(2, 300)
    log = tmp_path / "a.jsonl"
    log.write_bytes(b"".join(jsonl(items)) + b"junk\n")
    assert main(["audit", str(log), "--plain", "--window", "60", "--windows-kept", "10"]) == 0
    out = capsys.readouterr().out
    assert "GET /items/{id}" in out and "bad lines: json 1" in out and "dropped before counting" in out
    assert main(["audit", str(log), "--json", "--window", "60", "--windows-kept", "10"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["report"] == json.loads(json.dumps(live(items).report(items[-1][0]).to_dict() | {
        "dropped": {"bad line: json": 1}}))
    assert data["bad_lines"] == {"json": 1}
    assert main(["audit", str(tmp_path / "missing.log")]) == 1
    assert main(["audit", str(log), "--secret-env", "ASKONCE_TEST_UNSET_VARIABLE"]) == 1


def test_audit_reads_stdin(tmp_path: Path) -> None:
    lines = b"".join(nginx(T0 + i, f"GET /p/{i} HTTP/1.1", header(key(i))) for i in range(20))
    done = subprocess.run([sys.executable, "-m", "askonce.ledger_cli", "audit", "-", "--format", "nginx", "--json"],
                          input=lines, capture_output=True, timeout=60, check=True)
    data = json.loads(done.stdout)
    assert data["totals"]["arrivals"] == 20 and data["totals"]["amplification"] == 1.0


def test_report_command_reads_the_shared_ledger_from_redis(shared_redis: RedisServer,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    prefix = "cli" + uuid.uuid4().hex[:8]
    now = time.time()
    with RedisLedger(shared_redis.url, prefix=prefix, start=False) as shell:
        for attempt in (1, 2, 3):
            shell.record(now, "POST /[pay]", key=key(1), edge=True, path=(("gw", attempt),))
        shell.record(now, "POST /[pay]", key=None)
        expected = shell.report(now)
    assert main(["report", "--redis", shared_redis.url, "--prefix", prefix, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["operations"] == json.loads(json.dumps(expected.to_dict()))["operations"]
    assert main(["report", "--redis", shared_redis.url, "--prefix", prefix]) == 0  # rich, if installed
    out = capsys.readouterr().out
    assert "POST /[pay]" in out and "3.00" in out and "75.0%" in out
    assert main(["report", "--redis", shared_redis.url, "--prefix", "nothing-here"]) == 1
    assert main(["report", "--redis", "redis://127.0.0.1:1/0", "--timeout", "0.2"]) == 1


@pytest.fixture
def report_url() -> Iterator[str]:
    ledger = MemoryLedger()
    ledger.record(time.time(), "GET /x", key=key(1), edge=True)
    server = uvicorn.Server(uvicorn.Config(ReportApp(ledger), host="127.0.0.1", port=0, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    limit = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < limit
        time.sleep(0.01)
    yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}/askonce/"
    server.should_exit = True
    thread.join(10)


def test_report_command_reads_a_report_app(report_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "--url", report_url + "report.json", "--plain"]) == 0
    out = capsys.readouterr().out
    assert "GET /x" in out and "1.00" in out
    assert main(["report", "--url", report_url]) == 1  # the HTML page is no report
