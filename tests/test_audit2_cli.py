"""Audit 2, the ``askonce`` command with absurd flags and sources: a clear message and exit status 2 for
a usage error, 1 when the figures cannot be had; never a traceback."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from askonce.cli import main


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's usage errors
        code = int(exit_.code or 0)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


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
def test_audit_of_a_missing_or_malformed_file(content: bytes | None, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "log.jsonl"
    if content is not None:
        path.write_bytes(content)
    code, err = run(["audit", "--json", str(path)], capsys)
    assert code == (1 if content is None else 0), err  # a bad line is counted, not fatal


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


@pytest.mark.parametrize("flags", [
    ["--duration", "1e12"], ["--duration", "nan"], ["--duration", "0"], ["--rate", "-1"], ["--rate", "1e300"],
    ["--rate", "1e6", "--duration", "86400"],
    ["--budget", "-3"], ["--grace", "-1"],  # before any run: these were refused only after the first ones
])
def test_simulate_flags_that_make_no_sense_are_a_usage_error_before_anything_runs(
        flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(["simulate", "--scenario", "depth", "--quick", *flags], capsys)
    assert code == 2, err
    assert "A " not in err  # no scenario ran (its progress line says "A <amplification>")
