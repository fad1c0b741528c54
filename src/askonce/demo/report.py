"""The demo's outputs: the comparison table (rich), the JSON document, the HTML report with plots.

The report folder holds ``index.html``, ``results.json`` (what ``--json`` prints), the plots as PNG
(matplotlib, Agg backend: no display needed) and the processes' logs.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from askonce.demo.params import POLICIES, SCENARIOS, Scenario, kind
from askonce.demo.runner import Run

COLOURS = {"no-retry": "#7f7f7f", "naive": "#d62728", "askonce": "#2ca02c"}


def ordered(runs: Sequence[Run]) -> list[Run]:
    """Scenario order, then no-retry, naive, askonce (whatever order they ran in)."""
    return sorted(runs, key=lambda r: (SCENARIOS.index(kind(r.row["scenario"])),
                                       r.row["scenario"], POLICIES.index(r.row["policy"])))


def document(runs: Sequence[Run], goals: list[dict[str, Any]],
             meta: dict[str, Any]) -> dict[str, Any]:
    """The ``--json`` document: ``{"scenarios": [rows...], "goals": [...], ...}``."""
    return {"scenarios": [r.row for r in ordered(runs)], "goals": goals, **meta}


def _num(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table_rows(runs: Sequence[Run]) -> list[list[str]]:
    out = []
    for run in ordered(runs):
        r = run.row
        a = r["arrivals_per_question"]
        cov, rate = r["coverage"], r["success_rate"]
        recovery = "-" if r["scenario"] != "overload" else (
            "never" if r["recovery_s"] is None else f"{r['recovery_s']:.1f}")
        out.append([
            r["scenario"], r["policy"], str(r["questions"]), _num(a["mean"], ".3f"),
            _num(a["p99"], ".0f"), _num(a["max"], ".0f"), "-" if cov is None else f"{cov:.0%}",
            "-" if rate is None else f"{100 * rate:.1f}%", _num(r["latency_ms"]["p50"], ".0f"),
            _num(r["latency_ms"]["p99"], ".0f"),
            f"{_num(r.get('target_work_s'), '.1f')} ({_num(r.get('wasted_work_s'), '.1f')})",
            recovery,
        ])  # fmt: skip
    return out


HEADERS = ["scenario", "policy", "questions", "arrivals/q", "p99", "max", "coverage", "success",
           "p50 ms", "p99 ms", "work s (wasted)", "recovery s"]


def _mark(met: bool | None) -> tuple[str, str]:
    """A goal's (HTML class, word)."""
    return (("unjudged", "not judged") if met is None else ("met", "met") if met
            else ("unmet", "NOT met"))


def print_table(console: Any, runs: Sequence[Run], goals: list[dict[str, Any]],
                meta: dict[str, Any]) -> None:
    """The table (in two parts on a terminal narrower than it), then the goals and the notes."""
    from rich import box
    from rich.table import Table

    rows = table_rows(runs)
    wide = console.width >= 132
    parts = ([list(range(len(HEADERS)))] if wide
             else [list(range(8)), [0, 1, *range(8, len(HEADERS))]])
    for n, columns in enumerate(parts):
        title = ("askonce demo: arrivals per question at the target "
                 "(mean, p99, max over all questions)" if n == 0
                 else "latency, the target's work, recovery")
        table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
        for i in columns:
            table.add_column(HEADERS[i], justify="left" if i < 2 else "right")
        last = None
        for row in rows:
            if last is not None and row[0] != last:
                table.add_section()
            last = row[0]
            table.add_row(*(row[i] for i in columns))
        console.print(table)
    for g in goals:
        mark = ("[yellow]not judged[/yellow]" if g["met"] is None
                else "[green]met[/green]" if g["met"] else "[red]NOT met[/red]")
        console.print(f"  {mark}  {g['goal']}: {g['measured']}", highlight=False)
    for note in meta.get("notes", []):
        console.print(f"  [yellow]note[/yellow]  {note}", highlight=False)


def _plots(out: Path, runs: Sequence[Run], scenarios: dict[str, Scenario]) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made: list[tuple[str, str]] = []
    runs = ordered(runs)
    names = [s for s in SCENARIOS if any(r.row["scenario"] == s for r in runs)]
    if not names:
        return made

    fig, axes = plt.subplots(len(names), 1, figsize=(8, 2.4 * len(names)), squeeze=False)
    for ax, name in zip(axes[:, 0], names, strict=True):
        for run in (r for r in runs if r.row["scenario"] == name):
            xs = [t for t, _ in run.timeline]
            ys = [n for _, n in run.timeline]
            ax.plot(xs, ys, label=run.row["policy"], color=COLOURS[run.row["policy"]],
                    drawstyle="steps-post")
        trigger = scenarios[name].trigger
        if trigger is not None:
            ax.axvspan(trigger.start, trigger.end, color="#ffdd88", alpha=0.4, label="capacity cut")
        ax.set_yscale("symlog", linthresh=10)
        ax.set_title(f"{name}: arrivals per second at the target", fontsize=10)
        ax.legend(fontsize=8, loc="upper right")
    axes[-1, 0].set_xlabel("seconds into the run")
    fig.tight_layout()
    fig.savefig(out / "arrivals.png", dpi=100)
    plt.close(fig)
    made.append(("arrivals.png", "Arrivals per second at the target over each run (symlog scale)."))

    fig, ax = plt.subplots(figsize=(8, 3.2))
    width = 0.27
    for i, policy in enumerate(POLICIES):
        xs, means, p99s = [], [], []
        for j, name in enumerate(names):
            row = next((r.row for r in runs
                        if r.row["scenario"] == name and r.row["policy"] == policy), None)
            if row is not None and row["arrivals_per_question"]["mean"] is not None:
                xs.append(j + (i - 1) * width)
                means.append(row["arrivals_per_question"]["mean"])
                p99s.append(row["arrivals_per_question"]["p99"])
        if xs:
            ax.bar(xs, means, width, label=f"{policy} (mean)", color=COLOURS[policy])
            ax.scatter(xs, p99s, marker="_", s=200, color="black", zorder=3)
    ax.set_xticks(range(len(names)), names)
    ax.set_yscale("symlog", linthresh=2)
    ax.set_ylabel("arrivals per question")
    ax.set_title("Amplification at the target: mean (bars) and p99 (black ticks)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "amplification.png", dpi=100)
    plt.close(fig)
    made.append(("amplification.png",
                 "Arrivals per question at the target, per scenario and policy."))

    overload = [r for r in runs if r.row["scenario"] == "overload" and r.goodput]
    if overload:
        fig, ax = plt.subplots(figsize=(8, 3.2))
        for run in overload:
            ax.plot(range(len(run.goodput)), run.goodput, label=run.row["policy"],
                    color=COLOURS[run.row["policy"]], drawstyle="steps-post")
        trigger = scenarios["overload"].trigger
        if trigger is not None:
            ax.axvspan(trigger.start, trigger.end, color="#ffdd88", alpha=0.4,
                       label="capacity cut to 20%")
        ax.set_xlabel("seconds into the run")
        ax.set_ylabel("answered within the deadline / s")
        ax.set_title("Overload: goodput per second", fontsize=10)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "goodput.png", dpi=100)
        plt.close(fig)
        made.append(("goodput.png",
                     "Overload: questions answered within their deadline, per second."))
    return made


def write(out: Path, runs: Sequence[Run], doc: dict[str, Any],
          scenarios: dict[str, Scenario]) -> Path:
    """Write ``results.json``, the plots and ``index.html`` into ``out``; the path of the HTML
    page."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(doc, indent=2) + "\n")
    plots = _plots(out, runs, scenarios)
    e = html.escape
    head = "".join(f"<th>{e(h)}</th>" for h in HEADERS)
    body = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>"
                   for row in table_rows(runs))
    goals = "".join(f"<li class={_mark(g['met'])[0]}>"
                    f"{_mark(g['met'])[1]}: "
                    f"{e(g['goal'])} &mdash; {e(g['measured'])}</li>" for g in doc["goals"])
    notes = "".join(f"<li>{e(n)}</li>" for n in doc.get("notes", []))
    grace = f"; its clients' deadline_grace is {doc['grace']:g} s" if doc.get("grace") else ""
    params = "".join(f"<li><b>{e(s.name)}</b>: {e(s.note)}; "
                     f"{s.rate:g} questions/s for {s.duration:g} s</li>"
                     for s in scenarios.values() if any(r.row["scenario"] == s.name for r in runs))
    figures = "".join(f"<figure><img src='{e(f)}' alt='{e(c)}'>"
                      f"<figcaption>{e(c)}</figcaption></figure>"
                      for f, c in plots)
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>askonce demo</title><style>
body {{ font-family: system-ui, sans-serif; margin: 2em; max-width: 1100px; }}
table {{ border-collapse: collapse; font-size: 0.9em; }} \
td, th {{ border: 1px solid #ccc; padding: 0.25em 0.5em; }}
td:nth-child(n+3) {{ text-align: right; }} .met {{ color: #1a7f37; }} .unmet {{ color: #cf222e; }}
.unjudged {{ color: #9a6700; }}
figure {{ margin: 1.5em 0; }} img {{ max-width: 100%; }}
</style></head><body>
<h1>askonce demo</h1>
<p>{e(doc.get("command", ""))} &mdash; {e(doc.get("date", ""))}, {e(doc.get("machine", ""))}</p>
<p>A gateway (FastAPI, httpx) calls an API (Flask on waitress, requests), which calls a service \
(FastAPI,
httpx), which calls the target (Starlette, a fixed worker pool). Each middle layer tries 3 times. \
Naive: plain
per-layer retry loops. askonce: the question is minted at the edge \
(budget {e(str(doc.get("budget", 2)))}) and
every layer spends from it{e(grace)}. Arrivals are counted at the target, per question.</p>
<table><tr>{head}</tr>{body}</table>
<h2>Goals</h2><ul>{goals}</ul>
{"<h2>Notes</h2><ul>" + notes + "</ul>" if notes else ""}
<h2>Scenarios</h2><ul>{params}</ul>
{figures}
<p><a href="results.json">results.json</a> holds every figure.</p>
</body></html>
"""
    (out / "index.html").write_text(page)
    return out / "index.html"
