"""What a simulation run shows: text tables, a JSON document and plots.

matplotlib is imported only by :func:`plots` (with the Agg backend), so tables and JSON need nothing
beyond the standard library.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from askonce.sim.scenarios import Row

Column = tuple[str, int, Callable[[Row], str]]

# Lines that sit on top of each other (two policies at zero goodput) stay visible by their style.
_STYLE = {"no-retry": ":", "naive": "--", "bucket": "-.", "breaker": "-", "askonce": "-",
          "no-jitter": "--"}
_WIDTH = {"askonce": 2.0}


def _num(value: float | None, fmt: str = ".3f") -> str:
    return "-" if value is None else format(value, fmt)


def _int(value: int | None) -> str:
    return "-" if value is None else str(value)


def _pct(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value * 100:.{digits}f}%"


def _recovery(r: Row) -> str:
    if r.recovered is None:
        return "-"
    return f"{r.recovery_s:.1f} s" if r.recovered and r.recovery_s is not None else "never"


_POLICY: Column = ("policy", 11, lambda r: r.policy)
_A: list[Column] = [
    ("A mean", 8, lambda r: _num(r.mean)),
    ("p99", 5, lambda r: _int(r.p99)),
    ("max", 5, lambda r: _int(r.max)),
]
_STEADY: Column = ("A steady", 9, lambda r: _num(r.steady_mean))
_REACHED: Column = ("reached", 11, lambda r: f"{r.reached}/{r.questions}")
_SUCCESS: Column = ("success", 9, lambda r: _pct(r.success_rate))
_LOAD: Column = ("load", 7, lambda r: _num(r.arrivals / r.questions if r.questions else None))

COLUMNS: dict[str, list[Column]] = {
    "depth": [("N", 3, lambda r: str(r.params["depth"])), _POLICY, _REACHED, *_A, _STEADY,
              _LOAD],
    "transient": [
        ("N", 3, lambda r: str(r.params["depth"])),
        ("errors", 7, lambda r: _pct(r.params["error_rate"], 0)),
        _POLICY, *_A, _SUCCESS,
        ("p99 ms", 7, lambda r: _int(r.latency_p99_ms)),
    ],
    "clients": [("clients", 8, lambda r: str(r.params["clients"])), _POLICY, _REACHED, *_A,
                _STEADY, _LOAD],
    "overload": [
        ("T", 4, lambda r: f"{r.params['trigger_s']:g}s"),
        _POLICY, *_A, _SUCCESS,
        ("wasted", 7, lambda r: _pct(r.wasted_fraction, 0)),
        ("recovery", 9, _recovery),
        ("in cut", 7, lambda r: _pct(r.cut_goodput, 0)),
        ("per asked", 10, lambda r: "-" if r.recovered is None else
         "never" if r.recovery_asked_s is None else f"{r.recovery_asked_s:.1f} s"),
    ],
    "slow": [
        ("slow", 5, lambda r: _pct(r.params["slow_share"], 0)),
        _POLICY, *_A, _SUCCESS,
        ("p99 ms", 7, lambda r: _int(r.latency_p99_ms)),
        ("wasted", 7, lambda r: _pct(r.wasted_fraction, 0)),
    ],
    "tail": [
        ("N", 3, lambda r: str(r.params["depth"])),
        _POLICY, *_A, _LOAD, _SUCCESS,
        ("p50 ms", 7, lambda r: _int(r.latency_p50_ms)),
        ("p99 ms", 7, lambda r: _int(r.latency_p99_ms)),
    ],
    "stuck": [
        ("work", 5, lambda r: f"{r.params['slow_time']:g}s"),
        _POLICY, _SUCCESS, *_A, _LOAD,
        ("work/q", 7, lambda r: _num(r.work_s / r.questions if r.questions else None, ".2f")),
        ("polls/q", 8, lambda r: _num(r.polls / r.questions if r.questions else None, ".2f")),
        ("max", 4, lambda r: str(r.poll_max)),
        ("p99 ms", 7, lambda r: _int(r.latency_p99_ms)),
    ],
    "jitter": [
        _POLICY,
        ("calls", 7, lambda r: str(r.arrivals)),
        ("done", 8, lambda r: f"{round(r.success_rate * r.questions)}/{r.questions}"),
        ("completion", 11,
         lambda r: "-" if r.completion_s is None else f"{r.completion_s * 1000:.0f} ms"),
    ],
}

TITLES = {
    "depth": "E1 outage x depth: arrivals per question that reached the target (A); "
             "load = arrivals per question asked",
    "transient": "E2 transient errors: success within the deadline and A",
    "clients": "E5 client count (same total load, full outage): A; "
               "load = arrivals per question asked",
    "overload": "E3 overload: capacity cut for T s; recovery = until 5 s goodput is back to 90 % "
                "(per asked: goodput per question asked); in cut = goodput during the cut / what "
                "the reduced capacity could answer",
    "slow": "E11 a slow tail longer than every timeout: success, A, and the target's work wasted",
    "stuck": "E13 a target slower than every layer's timeout: success, A, load = arrivals per "
             "question asked, the target's work (s) and status polls (all hops) per question",
    "jitter": "E6 synchronised retries: calls and time until every client has written",
    "tail": "E12 a latency tail (2 % of arrivals take 20x the median): latency of successes, A, "
            "load = arrivals per question asked",
}


def table(rows: Sequence[Row]) -> str:
    """One text table per scenario present in ``rows``."""
    out: list[str] = []
    for scenario in dict.fromkeys(r.scenario for r in rows):
        cols = COLUMNS[scenario]
        mine = [r for r in rows if r.scenario == scenario]
        out.append(TITLES[scenario])
        out.append("  ".join(f"{name:>{w}}" if i else f"{name:<{w}}"
                             for i, (name, w, _) in enumerate(cols)))
        for r in mine:
            out.append("  ".join(f"{fn(r):>{w}}" if i else f"{fn(r):<{w}}"
                                 for i, (_, w, fn) in enumerate(cols)))
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def document(rows: Sequence[Row], meta: dict[str, Any]) -> dict[str, Any]:
    """The JSON document: ``{"simulator": meta, "scenarios": [row, ...]}``."""
    return {"simulator": meta, "scenarios": [r.to_dict() for r in rows]}


def plots(rows: Sequence[Row], folder: str) -> list[str]:
    """Write one PNG per scenario present in ``rows`` into ``folder``; the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(folder, exist_ok=True)
    written: list[str] = []

    def save(fig: Any, name: str) -> None:
        path = os.path.join(folder, name)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    def by_policy(mine: Sequence[Row]) -> dict[str, list[Row]]:
        out: dict[str, list[Row]] = {}
        for r in mine:
            out.setdefault(r.policy, []).append(r)
        return out

    scenarios = {r.scenario for r in rows}
    if "depth" in scenarios:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for policy, mine in by_policy([r for r in rows if r.scenario == "depth"]).items():
            ax.plot([r.params["depth"] for r in mine], [r.mean or 0 for r in mine], marker="o",
                    label=policy, linestyle=_STYLE.get(policy, "-"))
        ax.set(yscale="log", xlabel="retrying layers N", ylabel="arrivals per question (mean)",
               title="E1: full outage",
               xticks=sorted({r.params["depth"] for r in rows if r.scenario == "depth"}))
        ax.legend()
        save(fig, "depth.png")
    if "transient" in scenarios:
        mine = [r for r in rows if r.scenario == "transient"]
        depths = sorted({r.params["depth"] for r in mine})
        fig, axes = plt.subplots(2, len(depths), figsize=(5.2 * len(depths), 7), squeeze=False)
        for j, d in enumerate(depths):
            for policy, rs in by_policy([r for r in mine if r.params["depth"] == d]).items():
                x = [r.params["error_rate"] * 100 for r in rs]
                style = _STYLE.get(policy, "-")
                axes[0][j].plot(x, [r.success_rate * 100 for r in rs], marker="o", label=policy,
                                linestyle=style)
                axes[1][j].plot(x, [r.mean or 0 for r in rs], marker="o", label=policy,
                                linestyle=style)
            axes[0][j].set(title=f"E2: N={d}", ylabel="success within deadline (%)")
            axes[1][j].set(xlabel="target error rate (%)", ylabel="arrivals per question (mean)")
            axes[0][j].legend(fontsize=8)
        save(fig, "transient.png")
    if "clients" in scenarios:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for policy, rs in by_policy([r for r in rows if r.scenario == "clients"]).items():
            ax.plot([r.params["clients"] for r in rs], [r.mean or 0 for r in rs], marker="o",
                    label=policy, linestyle=_STYLE.get(policy, "-"))
        ax.set(xscale="log", xlabel="clients (same total load)",
               ylabel="arrivals per question (mean)", title="E5: full outage")
        ax.legend()
        save(fig, "clients.png")
    if "overload" in scenarios:
        mine = [r for r in rows if r.scenario == "overload"]
        triggers = sorted({r.params["trigger_s"] for r in mine})
        fig, axes = plt.subplots(len(triggers), 1, figsize=(8, 2.6 * len(triggers)),
                                 squeeze=False)
        for i, t in enumerate(triggers):
            ax = axes[i][0]
            start = 0.0
            for r in (r for r in mine if r.params["trigger_s"] == t):
                ax.plot(range(len(r.goodput)), r.goodput, label=f"{r.policy} ({_recovery(r)})",
                        linestyle=_STYLE.get(r.policy, "-"), linewidth=_WIDTH.get(r.policy, 1.0))
                start = r.params["start_s"]
            ax.axvspan(start, start + t, color="grey", alpha=0.2)
            ax.set(ylabel="goodput (q/s)", title=f"E3: capacity cut for {t:g} s")
            ax.legend(fontsize=7, loc="upper right")
        axes[-1][0].set(xlabel="time (s)")
        save(fig, "overload.png")
    if "jitter" in scenarios:
        mine = [r for r in rows if r.scenario == "jitter"]
        fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3.4))
        names = [r.policy for r in mine]
        a.bar(names, [r.arrivals for r in mine])
        a.set(ylabel="calls", title="E6: total calls")
        b.bar(names, [(r.completion_s or 0) * 1000 for r in mine])
        b.set(ylabel="ms", title="time until the last write")
        save(fig, "jitter.png")
    return written
