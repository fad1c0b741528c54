"""The ledger's commands: ``askonce audit`` (access logs) and ``askonce report`` (the shared ledger in Redis,
or a report app's URL); flags that make no sense are a usage error (exit status 2), figures that cannot
be had exit 1, and neither is ever a traceback."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn

from access_logs import T0, header, jsonl, key, live, nginx, traffic
from askonce.cli import main
from askonce.ledger.report_app import ReportApp
from askonce.ledger.store import MemoryLedger, RedisLedger
from cli_run import one_line_error, run, run_cli
from redis_server import RedisServer

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
    done = subprocess.run([sys.executable, "-m", "askonce", "audit", "-", "--format", "nginx", "--json"],
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


# --- what makes no sense ---------------------------------------------------------------------------------


@pytest.fixture
def log(tmp_path: Path) -> str:
    path = tmp_path / "access.jsonl"
    path.write_text('{"time": 1700000000, "operation": "get"}\n')
    return str(path)


@pytest.mark.parametrize("flags", [
    ["--window", "nan"], ["--window", "0"], ["--window", "-60"], ["--window", "1e300"],
    ["--windows-kept", "-1"], ["--windows-kept", "1000000000"], ["--max-exact-keys", "-5"],
    ["--format", "nginx", "--field", "0"], ["--format", "nginx", "--regex", "("],
])
def test_audit_flags_that_make_no_sense_are_a_usage_error(flags: list[str], log: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(["audit", *flags, log], capsys)
    assert code == 2, err
    assert err.startswith("askonce audit: ") or "error:" in err


@pytest.mark.parametrize("content", [None, b"{not json\n", b"\x00\xff\xfe garbage\n", b"[1, 2]\n"])
def test_audit_of_a_missing_or_unreadable_file(content: bytes | None, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """No line read at all: the figures cannot be had (1), said in one line; a bad line among good
    ones is counted, not fatal (test_audit_command_table_and_json)."""
    path = tmp_path / "log.jsonl"
    if content is not None:
        path.write_bytes(content)
    code, err = run(["audit", "--json", str(path)], capsys)
    assert code == 1 and err.startswith("askonce audit: ") and len(err.splitlines()) == 1, err
    if content is not None:
        assert "no line of its 1 could be read" in err


def test_audit_of_an_nginx_log_read_as_json_lines_says_which_flag_reads_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "access.log"
    path.write_bytes(b"".join(nginx(T0 + i, f"GET /p/{i} HTTP/1.1", header(key(i)))
                              for i in range(3)))
    code, err = run(["audit", str(path)], capsys)
    assert code == 1 and "add --format nginx" in err and len(err.splitlines()) == 1, err
    code, err = run(["audit", "--format", "nginx", "--json", str(path)], capsys)
    assert code == 0, err
    empty = tmp_path / "empty.log"
    empty.write_bytes(b"")
    assert run(["audit", "--json", str(empty)], capsys)[0] == 0  # nothing to read: no arrivals


@pytest.mark.parametrize("timeout", ["nan", "0", "-1", "inf", "soon"])
def test_report_timeout_that_makes_no_sense_is_a_usage_error(timeout: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(["report", "--timeout", timeout, "--redis", "redis://127.0.0.1:1/0"], capsys)
    assert code == 2, err


@pytest.fixture
def server() -> Iterator[tuple[str, list[bytes]]]:
    bodies: list[bytes] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = bodies.pop(0)  # each body is served once: a test sees whether it was asked for
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/askonce/report.json", bodies
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


@pytest.mark.parametrize("body", [
    {"operations": [{}]},
    {"operations": [{"start": "yesterday"}]},
    {"operations": [None]},
    {"operations": [{"start": 1e300, "current": True, "operation": "x", "arrivals": 1, "attributable": 0,
                     "distinct_keys": 0, "approximate": False, "amplification": None, "coverage": None,
                     "per_key": {"p50": None, "p99": None, "max": None}, "undeclared_retries": 0, "refused": 0,
                     "reminted_by": {}, "retries_by": {}}]},
    [1, 2, 3],
    "just a string",
])
def test_report_from_a_url_answering_a_malformed_report(body: object, server: tuple[str, list[bytes]],
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    url, bodies = server
    bodies.append(json.dumps(body).encode())
    code, err = run(["report", "--plain", "--url", url, "--timeout", "5"], capsys)
    assert code == 1, err
    assert err.startswith("askonce report: ")
    # the answer was read and judged, not a fetch that failed (which prints the same prefix)
    assert "answered a malformed report" in err or "did not answer with a ledger report" in err, err
    assert bodies == []  # the server was asked for it


def test_report_from_a_url_answering_an_html_page(server: tuple[str, list[bytes]]) -> None:
    url, bodies = server
    bodies.append(b"<!doctype html><html><body>Welcome to nginx!</body></html>")
    done = run_cli(["report", "--url", url, "--timeout", "5"])
    err = one_line_error(done, 1, "did not answer with an askonce report", "not JSON")
    assert "Expecting value" not in err


def test_report_into_a_closed_stdout_exits_quietly(server: tuple[str, list[bytes]]) -> None:
    url, bodies = server
    ops = [{"start": T0, "current": False, "operation": f"op{i}", "arrivals": 1, "attributable": 0,
            "distinct_keys": 0, "approximate": False, "amplification": None, "coverage": None,
            "per_key": {"p50": None, "p99": None, "max": None}, "undeclared_retries": 0, "refused": 0,
            "reminted_by": {}, "retries_by": {}} for i in range(2000)]  # more than a pipe holds
    bodies.append(json.dumps({"operations": ops}).encode())
    proc = subprocess.Popen([sys.executable, "-m", "askonce.cli", "report", "--json", "--url", url],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.read(10)  # `| head -c 10`
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(30) == 1, err  # as the Python docs' recipe for SIGPIPE exits
    assert err == "", err


def test_report_without_the_redis_package_names_the_extra() -> None:
    done = run_cli(["report", "--redis", "redis://127.0.0.1:1/0"], block=("redis",))
    one_line_error(done, 1, "redis", "pip install 'askonce[redis]'")
