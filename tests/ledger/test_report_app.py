"""The report app: JSON and dashboard in-process, over a real uvicorn, and rendered by headless Chromium."""

from __future__ import annotations

import html.parser
import json
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import uvicorn

from askonce.core.ledger import LedgerPolicy, Report
from askonce.ledger.report_app import ReportApp
from askonce.ledger.store import LedgerUnavailable, MemoryLedger

NOW = 1_700_000_125.0  # a fixed wall clock: windows 1_700_000_040, _100 (60 s each) are in the report
CHROMIUM = next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None)


def filled() -> MemoryLedger:
    ledger = MemoryLedger(LedgerPolicy(window=60.0, windows_kept=3))
    for start in (NOW - 120, NOW - 60, NOW):
        for i in range(10):  # an honest operation
            ledger.record(start, "GET /items/{id}", key=f"honest-{start}-{i}", edge=True, path=(("gw", 1),))
        for i in range(5):  # one that retries three times per question, and a hop that re-mints half
            for attempt in (1, 2, 3):
                ledger.record(start, "POST /<pay>", key=f"pay-{start}-{i}", edge=True, path=(("gw", attempt),))
            ledger.record(start, "POST /<pay>", key=f"local-{start}-{i}", origin="mid")
    ledger.note_dropped(3, "buffer-full")
    return ledger


@pytest.fixture
def client() -> Iterator[httpx.AsyncClient]:
    app = ReportApp(filled(), clock=lambda: NOW, poll=0.5)
    yield httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


async def test_report_json_is_the_report(client: httpx.AsyncClient) -> None:
    r = await client.get("/askonce/report.json")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert r.headers["cache-control"] == "no-store"
    assert r.json() == json.loads(json.dumps(filled().report(NOW).to_dict()))
    head = await client.head("/askonce/report.json")
    assert head.status_code == 200 and head.content == b"" and int(head.headers["content-length"]) > 100


async def test_routes(client: httpx.AsyncClient) -> None:
    page = await client.get("/askonce/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "const POLL_MS = 500," in page.text
    assert "http://" not in page.text.replace("http://www.w3.org/2000/svg", "")  # nothing from elsewhere
    moved = await client.get("/askonce")
    assert moved.status_code == 308 and moved.headers["location"] == "/askonce/"
    assert (await client.post("/askonce/report.json")).status_code == 405
    assert (await client.get("/elsewhere")).status_code == 404


async def test_other_paths_and_scopes_go_to_the_wrapped_app() -> None:
    seen: list[str] = []

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        seen.append(f"{scope['type']} {scope.get('path', '')}")
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 204, "headers": []})
            await send({"type": "http.response.body", "body": b""})

    app = ReportApp(MemoryLedger(), app=inner, prefix="/ops/ledger")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        assert (await c.get("/api/x")).status_code == 204
        assert (await c.get("/ops/ledger/report.json")).status_code == 200
    await app({"type": "lifespan"}, _never, _ignore)
    assert seen == ["http /api/x", "lifespan "]


async def _never() -> dict[str, Any]:
    raise AssertionError("not called")


async def _ignore(message: Any) -> None:
    return None


async def test_lifespan_without_an_inner_app_is_acknowledged() -> None:
    messages = iter([{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}])
    sent: list[str] = []

    async def receive() -> dict[str, Any]:
        return next(messages)

    async def send(message: Any) -> None:
        sent.append(message["type"])

    await ReportApp(MemoryLedger())({"type": "lifespan"}, receive, send)
    assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]


async def test_a_report_that_fails_is_a_503_with_the_reason() -> None:
    class Away:
        def report(self, now: float) -> Report:
            raise LedgerUnavailable("redis away")

        def record(self, *a: Any, **k: Any) -> bool:
            return True

    app = ReportApp(Away())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        r = await c.get("/askonce/report.json")
    assert r.status_code == 503 and r.json() == {"error": "LedgerUnavailable: redis away"}


@pytest.mark.parametrize("kwargs", [{"prefix": "askonce"}, {"prefix": "/askonce/"}, {"prefix": "/a'b"}, {"poll": 0}])
def test_options_are_checked(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        ReportApp(MemoryLedger(), **kwargs)
    with pytest.raises(ValueError):
        ReportApp(object())  # type: ignore[arg-type]


REFUSED: list[Any] = [
    pytest.param(lambda: ReportApp(MemoryLedger(), prefix=5), id="report app prefix int (AttributeError)"),  # type: ignore[arg-type]
    pytest.param(lambda: ReportApp(MemoryLedger(), clock=5), id="report app clock not callable"),  # type: ignore[arg-type]
    pytest.param(lambda: ReportApp(MemoryLedger(), poll=True), id="report app poll bool"),
]


@pytest.mark.parametrize("make", REFUSED)
def test_a_misconfiguration_is_refused_at_construction(make: Callable[[], object]) -> None:
    with pytest.raises(ValueError):
        make()


# --- a real server, and a real browser ------------------------------------------------------------------


@pytest.fixture(scope="module")
def served() -> Iterator[str]:
    server = uvicorn.Server(uvicorn.Config(ReportApp(filled(), clock=lambda: NOW, poll=0.5), host="127.0.0.1",
                                           port=0, lifespan="on", log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    limit = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < limit, "uvicorn did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}/askonce/"
    server.should_exit = True
    thread.join(10)


def test_both_endpoints_over_a_real_server(served: str) -> None:
    page = httpx.get(served, timeout=5)
    data = httpx.get(served + "report.json", timeout=5).json()
    assert page.status_code == 200 and "<svg" not in page.text  # the charts are drawn by the script
    # an empty icon of its own: a browser asks for no /favicon.ico, which would reach the app behind
    # and its ledger as an unmatched operation
    assert '<link rel="icon" href="data:,">' in page.text
    assert [(o["operation"], o["amplification"]) for o in data["operations"] if o["current"]] == [
        ("GET /items/{id}", 1.0), ("POST /<pay>", 3.0)]


class _Dom(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[str, dict[str, str]] = {}
        self.charts: list[dict[str, str]] = []
        self.polylines = 0
        self.status = ""
        self._in_status = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "tr" and "data-operation" in a:
            self.rows[a["data-operation"]] = a
        elif tag == "svg" and "data-metric" in a:
            self.charts.append(a)
        elif tag == "polyline":
            self.polylines += 1
        self._in_status = a.get("id") == "status"

    def handle_data(self, data: str) -> None:
        if self._in_status:
            self.status += data


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_the_dashboard_renders_in_headless_chromium(served: str) -> None:
    assert CHROMIUM is not None
    with tempfile.TemporaryDirectory(prefix="askonce-chromium-") as profile:
        done = subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--virtual-time-budget=3000", "--dump-dom",
             served],
            capture_output=True, text=True, timeout=90,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    dom = _Dom()
    dom.feed(done.stdout)
    assert dom.rows["GET /items/{id}"]["data-amplification"] == "1.00"
    assert dom.rows["GET /items/{id}"]["data-coverage"] == "1.000"
    assert dom.rows["POST /<pay>"]["data-amplification"] == "3.00"  # a name that would be markup, as text
    assert dom.rows["POST /<pay>"]["data-coverage"] == "0.750"
    charts = {(c["data-operation"], c["data-metric"]): c["data-points"] for c in dom.charts}
    assert charts == {(op, m): "3" for op in ("GET /items/{id}", "POST /<pay>") for m in ("amp", "cov")}
    assert dom.polylines == 4
    assert "3 arrivals dropped before counting (buffer-full 3)" in dom.status
