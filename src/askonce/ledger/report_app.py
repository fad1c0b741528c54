"""A tiny pure-ASGI app that publishes a ledger: ``report.json`` and a self-contained dashboard.

::

    from askonce.ledger.report_app import ReportApp
    app = ReportApp(ledger)                    # serve it alone (uvicorn module:app), or
    app = ReportApp(ledger, app=your_app)      # in front of your app: other paths go to it

* ``GET {prefix}/report.json`` - ``Report.to_dict()`` of ``ledger.report(time.time())`` (503 with
  ``{"error": ...}`` if the report cannot be had, e.g. a :class:`RedisLedger` whose Redis is away);
* ``GET {prefix}/`` - a dashboard that polls ``report.json`` every ``poll`` seconds and draws, per
  operation, amplification and coverage over time (inline SVG; no script or style from anywhere
  else, for machines without internet access). It keeps the windows it has seen while the page is
  open, so the history grows beyond what the ledger keeps.

The report is computed in a worker thread (``asyncio.to_thread``): a Redis-backed report does I/O.
Non-HTTP scopes and other paths go to ``app`` (without one: 404, and lifespan is acknowledged).
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from askonce import _stats
from askonce.core import is_real
from askonce.ledger.store import LedgerShell

__all__ = ["ReportApp"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class ReportApp:
    """See the module docstring. ``clock`` gives the wall-clock ``now`` for each report."""

    def __init__(self, ledger: LedgerShell, *, app: ASGIApp | None = None, prefix: str = "/askonce",
                 poll: float = 5.0, clock: Callable[[], float] = time.time) -> None:
        if not callable(getattr(ledger, "report", None)):
            raise ValueError("ledger must have a report(now) method (MemoryLedger, RedisLedger)")
        if (not isinstance(prefix, str) or not prefix.startswith("/") or prefix.endswith("/")
                or any(c in prefix for c in "\"'<>\\ ")):
            raise ValueError("prefix must look like '/askonce' (leading slash, no trailing one), "
                             f"got {prefix!r}")
        if not is_real(poll) or not 0.1 <= poll <= 3600:
            raise ValueError(f"poll must be within 0.1..3600 seconds, got {poll!r}")
        if not callable(clock):
            raise ValueError(f"clock must be callable, got {clock!r}")
        self.ledger = ledger
        self.app = app
        self.prefix = prefix
        self.clock = clock
        self._page = DASHBOARD.replace("__POLL_MS__", str(int(poll * 1000))).encode("utf-8")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope.get("path", "")
            if path in (f"{self.prefix}/report.json", f"{self.prefix}/", self.prefix):
                await self._serve(scope, path, send)
                return
        if self.app is not None:
            await self.app(scope, receive, send)
        elif scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        elif scope["type"] == "http":
            await _respond(send, 404, b"not found\n", "text/plain; charset=utf-8")
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1000})

    async def _serve(self, scope: Scope, path: str, send: Send) -> None:
        method = scope.get("method", "GET")
        if method not in ("GET", "HEAD"):
            await _respond(send, 405, b"method not allowed\n", "text/plain; charset=utf-8",
                           [(b"allow", b"GET, HEAD")])
            return
        head = method == "HEAD"
        if path == self.prefix:
            await _respond(send, 308, b"", "text/plain; charset=utf-8",
                           [(b"location", f"{path}/".encode())])
        elif path.endswith("/"):
            await _respond(send, 200, self._page, "text/html; charset=utf-8", head=head)
        else:
            status, body = await self._report()
            await _respond(send, status, body, "application/json", head=head)

    async def _report(self) -> tuple[int, bytes]:
        import asyncio

        try:
            report = await asyncio.to_thread(self.ledger.report, self.clock())
            body = json.dumps(report.to_dict(), allow_nan=False, separators=(",", ":"))
        except Exception as exc:  # a report that cannot be had is an answer, not a server crash
            _stats.count("report_app.error")
            return 503, json.dumps({"error": f"{type(exc).__name__}: {exc}"[:500]}).encode()
        return 200, body.encode()


async def _respond(send: Send, status: int, body: bytes, content_type: str,
                   extra: list[tuple[bytes, bytes]] | None = None, *, head: bool = False) -> None:
    headers = [(b"content-type", content_type.encode()),
               (b"content-length", str(len(body)).encode()),
               (b"cache-control", b"no-store"), *(extra or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": b"" if head else body})


# The dashboard: one page, no external resources. Data goes into the DOM through textContent and
# setAttribute only (operation names come from requests and must not become markup).
DASHBOARD = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>askonce ledger</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222;background:#fafafa}
h1{font-size:1.3em;margin:0 0 .2em} #status{color:#555;margin-bottom:1em} #status.bad{color:#b00}
table{border-collapse:collapse;margin-bottom:1.5em;background:#fff}
th,td{border:1px solid #ddd;padding:.3em .6em;text-align:right}
th:first-child,td:first-child{text-align:left}
td.warn{background:#fde8e8} .cards{display:flex;flex-wrap:wrap;gap:1em}
.card{background:#fff;border:1px solid #ddd;padding:.6em;width:760px}
.card h2{font-size:1em;margin:0 0 .4em}
svg{background:#fff} .axis{stroke:#999;stroke-width:1} .ref{stroke:#2a2;stroke-dasharray:4 3}
.amp{fill:none;stroke:#c33;stroke-width:2} .cov{fill:none;stroke:#36c;stroke-width:2}
text{font-size:11px;fill:#555}
</style></head><body>
<h1>askonce ledger</h1>
<div id="status">loading&hellip;</div>
<p>Amplification = attributable arrivals per distinct question key (1.00 when every layer is
honest); coverage = share of arrivals that carry an originator's key. Latest window per
operation:</p>
<table id="ops"><thead><tr><th>operation</th><th>window start (UTC)</th><th>arrivals</th>
<th>amplification</th><th>coverage</th><th>distinct keys</th><th>p99 / max per key</th>
<th>undeclared retries</th><th>refused</th><th>re-minted by</th><th>retries by</th></tr></thead>
<tbody></tbody></table>
<div class="cards" id="charts"></div>
<script>
"use strict";
const POLL_MS = __POLL_MS__, MAX_POINTS = 240, NS = "http://www.w3.org/2000/svg";
const history = new Map();  // operation -> Map(window start -> {amp, cov})
function fmt(x, d) { return (x === null || x === undefined) ? "\\u2013" : x.toFixed(d); }
function pct(x) { return (x === null || x === undefined) ? "\\u2013" : (100 * x).toFixed(1) + "%"; }
function names(m) { return Object.entries(m).map(([k, v]) => k + " " + v).join(", ") || "\\u2013"; }
function el(tag, attrs, text) {
  const e = tag.startsWith("svg:") ? document.createElementNS(NS, tag.slice(4))
                                   : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  if (text !== undefined) e.textContent = text;
  return e;
}
function chart(op, points, key, cls, top, ref, label) {
  const W = 360, H = 130, L = 44, R = 8, T = 16, B = 22;
  const vals = points.filter(p => p[key] !== null);
  const svg = el("svg:svg", {width: W, height: H, class: "chart", "data-operation": op,
                             "data-metric": key, "data-points": vals.length});
  const hi = key === "cov" ? 1 : Math.max(top, ...vals.map(p => p[key] * 1.1));
  const hhmm = t => new Date(t * 1000).toISOString().slice(11, 16);
  const t0 = points.length ? points[0].start : 0,
        t1 = points.length ? points[points.length - 1].start : 1;
  const x = t => L + (W - L - R) * (t1 > t0 ? (t - t0) / (t1 - t0) : 0.5);
  const y = v => T + (H - T - B) * (1 - v / hi);
  svg.append(el("svg:line", {class: "axis", x1: L, y1: y(0), x2: W - R, y2: y(0)}),
             el("svg:line", {class: "axis", x1: L, y1: T, x2: L, y2: y(0)}),
             el("svg:line", {class: "ref", x1: L, y1: y(ref), x2: W - R, y2: y(ref)}),
             el("svg:text", {x: 2, y: y(ref) + 4}, key === "cov" ? pct(ref) : fmt(ref, 2)),
             el("svg:text", {x: L + 70, y: H - 6}, label));
  if (hi !== ref) svg.append(el("svg:text", {x: 2, y: y(hi) + 4}, fmt(hi, 2)));
  if (points.length) {
    svg.append(el("svg:text", {x: L, y: H - 6}, hhmm(t0)));
    if (t1 > t0) svg.append(el("svg:text", {x: W - R - 30, y: H - 6}, hhmm(t1)));
  }
  if (vals.length) {
    svg.append(el("svg:polyline",
                  {class: cls, points: vals.map(p => x(p.start) + "," + y(p[key])).join(" ")}));
    const last = vals[vals.length - 1];
    svg.append(el("svg:circle", {cx: x(last.start), cy: y(last[key]), r: 3, fill: "#333"}));
    svg.append(el("svg:text", {x: W - R - 60, y: T - 4},
                  "now " + (key === "cov" ? pct(last[key]) : fmt(last[key], 2))));
  }
  return svg;
}
function render(r) {
  const latest = new Map();
  for (const o of r.operations) {
    let h = history.get(o.operation);
    if (!h) { h = new Map(); history.set(o.operation, h); }
    h.set(o.start, {start: o.start, amp: o.amplification, cov: o.coverage});
    if (h.size > MAX_POINTS) h.delete(Math.min(...h.keys()));
    latest.set(o.operation, o);  // operations arrive in window order: the last one is the newest
  }
  const body = document.querySelector("#ops tbody");
  body.replaceChildren();
  for (const [op, o] of latest) {
    const tr = el("tr", {"data-operation": op, "data-amplification": fmt(o.amplification, 2),
                         "data-coverage": fmt(o.coverage, 3),
                         "data-undeclared": o.undeclared_retries});
    const cells = [op, new Date(o.start * 1000).toISOString().slice(0, 19).replace("T", " "),
                   o.arrivals, fmt(o.amplification, 2) + (o.approximate ? " ~" : ""),
                   pct(o.coverage), o.distinct_keys,
                   (o.per_key.p99 ?? "\\u2013") + " / " + (o.per_key.max ?? "\\u2013"),
                   o.undeclared_retries, o.refused, names(o.reminted_by), names(o.retries_by)];
    cells.forEach((c, i) => {
      const td = el("td", {}, String(c));
      if ((i === 3 && o.amplification > 1.5) ||
          (i === 4 && o.coverage !== null && o.coverage < 0.9) ||
          (i === 7 && o.undeclared_retries > 0)) td.className = "warn";
      tr.append(td);
    });
    body.append(tr);
  }
  const charts = document.getElementById("charts");
  charts.replaceChildren();
  for (const [op, h] of [...history].sort((a, b) => a[0] < b[0] ? -1 : 1)) {
    const points = [...h.values()].sort((a, b) => a.start - b.start);
    const card = el("div", {class: "card"});
    card.append(el("h2", {}, op),
                chart(op, points, "amp", "amp", 2, 1, "amplification per window"),
                chart(op, points, "cov", "cov", 1, 1, "coverage per window"));
    charts.append(card);
  }
  const dropped = Object.values(r.dropped).reduce((a, b) => a + b, 0);
  status("updated " + new Date(r.generated_at * 1000).toISOString().slice(11, 19) +
         " UTC; window " + r.window + " s; " + latest.size + " operations" +
         (r.approximate ? "; some figures approximate" : "") +
         (dropped ? "; " + dropped + " arrivals dropped before counting (" + names(r.dropped) +
                    ")" : ""),
         dropped > 0);
}
function status(text, bad) {
  const s = document.getElementById("status");
  s.textContent = text;
  s.className = bad ? "bad" : "";
}
async function tick() {
  try {
    const res = await fetch("report.json", {cache: "no-store"});
    const r = await res.json();
    if (!res.ok) throw new Error(r.error || ("HTTP " + res.status));
    render(r);
  } catch (e) {
    status("cannot read the report: " + e.message, true);
  }
}
tick();
setInterval(tick, POLL_MS);
</script></body></html>
"""
