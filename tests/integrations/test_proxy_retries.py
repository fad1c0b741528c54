"""A proxy's own retries (nginx ``proxy_next_upstream``) in front of a joining target.

nginx lists the target twice as upstream servers, so that a try that times out goes on to the "next"
one (the same target); the target is ``AskonceASGIMiddleware(JoinASGIMiddleware(app))`` with a ledger.
The handler runs once per question while the ledger counts every arrival, the proxy's undeclared
retries included; ``askonce audit --format nginx --upstream`` reads the same figures off nginx's own
access log with the log format docs/ledger.md gives.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from askonce.client import ClientPolicy
from askonce.integrations.httpx import AskonceTransport
from askonce.ledger.audit import LogFormat, audit_file
from e2e_services import uvicorn_running
from integrations.test_answer_once import Effects, _target

# docs/ledger.md, "A proxy in front of the target"
LOG_FORMAT = ("'$remote_addr [$time_local] \"$request\" $status \"$http_askonce_question\" "
              "\"$upstream_status\"'")

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def nginx_in_front_of(upstream: str, tmp: Path) -> Iterator[str]:
    """nginx on a free port proxying to ``upstream`` (listed twice, so that a timed-out try goes
    on to the "next" server: the same one), read timeout 0.3 s, up to 3 tries."""
    binary = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(binary).exists():
        pytest.skip("nginx is not installed (scripts/test.sh installs it)")
    port = _free_port()
    host = upstream.removeprefix("http://")
    (tmp / "logs").mkdir()
    conf = tmp / "nginx.conf"
    conf.write_text(f"""
daemon off;
master_process off;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 256; }}
http {{
    log_format askonce {LOG_FORMAT};
    access_log {tmp}/access.log askonce;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    upstream target {{
        server {host} max_fails=0;
        server {host} max_fails=0;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://target;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_read_timeout 300ms;
            proxy_next_upstream error timeout;
            proxy_next_upstream_tries 3;
        }}
    }}
}}
""")
    proc = subprocess.Popen([binary, "-p", str(tmp), "-c", str(conf)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        limit = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                break
            if proc.poll() is not None or time.monotonic() > limit:
                err = proc.stderr.read().decode() if proc.stderr else ""
                raise RuntimeError(f"nginx did not start: {err}")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def test_a_proxys_own_retries_join_the_run_and_the_ledger_counts_them(tmp_path: Path) -> None:
    effects = Effects(slow=0.5, share=1.0)  # every question's first run outlasts nginx's 0.3 s
    app, ledger = _target(effects)
    policy = ClientPolicy(layer="edge", originator=True, bucket=None, rejoin=False)
    questions = 20
    with uvicorn_running(app) as url, nginx_in_front_of(url, tmp_path) as proxy, \
            httpx.Client(transport=AskonceTransport(httpx.HTTPTransport(), policy=policy),
                         timeout=5.0) as http, concurrent.futures.ThreadPoolExecutor(10) as pool:
        statuses = list(pool.map(lambda _: http.get(proxy + "/orders").status_code,
                                 range(questions)))
    assert statuses == [200] * questions
    assert len(effects.done) == questions and set(effects.done.values()) == {1}  # ran once each
    (op,) = ledger.report(now=time.time()).operations
    assert op.distinct_keys == questions
    assert op.arrivals >= 2 * questions  # nginx tried each question again after 0.3 s
    assert op.undeclared_retries == op.arrivals - questions  # ... and the ledger saw it happen




def test_an_audit_of_the_proxys_log_reads_what_the_targets_ledger_counted(tmp_path: Path) -> None:
    effects = Effects(slow=0.5, share=0.5)  # half the questions' first runs outlast 0.3 s
    app, ledger = _target(effects)
    policy = ClientPolicy(layer="edge", originator=True, bucket=None, rejoin=False)
    with uvicorn_running(app) as url, nginx_in_front_of(url, tmp_path) as proxy, \
            httpx.Client(transport=AskonceTransport(httpx.HTTPTransport(), policy=policy),
                         timeout=5.0) as http, concurrent.futures.ThreadPoolExecutor(10) as pool:
        assert set(pool.map(lambda _: http.get(proxy + "/orders").status_code, range(40))) == {200}
    live = ledger.report(now=time.time()).totals()
    audited = audit_file(str(tmp_path / "access.log"), LogFormat(kind="nginx", upstream=True),
                         engine="python").report.totals()
    assert live.undeclared_retries > 0  # nginx did retry
    assert audited.arrivals == live.arrivals and audited.distinct_keys == live.distinct_keys
    assert audited.undeclared_retries == live.undeclared_retries
    plain = audit_file(str(tmp_path / "access.log"), LogFormat(kind="nginx")).report.totals()
    assert plain.undeclared_retries == 0  # one line per client request: blind without --upstream
