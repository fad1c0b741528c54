"""``askonce demo``: start the stack, run the scenarios, print the table, write the report.

One stack runs every scenario in turn, one run at a time (runs side by side would share the CPU,
and on a small machine the figures would measure it). Every process is stopped at the end, on an
error, on Ctrl-C and on SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import importlib.util
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from askonce.demo.params import DEMO_BUDGET, POLICIES, SCENARIOS, Scenario, scenarios

NEEDED = ("fastapi", "starlette", "uvicorn", "flask", "waitress", "httpx", "requests", "rich",
          "matplotlib")
# Overload: the naive collapse last, so no run inherits it.
RUN_ORDER = ("no-retry", "askonce", "naive")


@dataclass(frozen=True, slots=True)
class Options:
    scenarios: tuple[str, ...] = SCENARIOS
    quick: bool = False
    json: bool = False
    out: Path | None = None
    redis: str | None = None
    seed: int = 1
    budget: int = DEMO_BUDGET
    grace: float = 0.0
    join: bool = True
    breaker: bool = False
    error_rates: tuple[float, ...] = ()
    command: str = "askonce demo"


def missing_packages() -> list[str]:
    return [name for name in NEEDED if importlib.util.find_spec(name) is None]


def check_redis(url: str) -> str | None:
    """Why ``--redis`` cannot be used, or ``None``."""
    try:
        import redis

        from askonce.ledger.store import RedisLedger  # noqa: F401
        from askonce.stores.aredis import AsyncRedisStore  # noqa: F401
        from askonce.stores.redis import RedisStore  # noqa: F401
    except ImportError as exc:
        return f"--redis needs askonce's Redis store and ledger and the redis package ({exc})"
    try:
        client = redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
        client.ping()
        client.close()
    except Exception as exc:
        return f"cannot reach Redis at {url}: {exc}"
    return None


def lanes(chosen: dict[str, Scenario]) -> list[list[tuple[Scenario, str]]]:
    """The runs of each stack, in order: one stack, one run at a time (a second stack beside it
    would share the CPU, and the figures would measure the machine). Naive before askonce;
    overload: no-retry, askonce, naive."""
    def runs(s: Scenario) -> list[tuple[Scenario, str]]:
        order = RUN_ORDER if s.name == "overload" else POLICIES
        return [(s, p) for p in order if p in s.policies]

    return [[r for s in chosen.values() for r in runs(s)]]


def run_demo(opts: Options) -> int:
    from askonce._cli import USAGE, fail, writable_dir

    missing = missing_packages()
    if missing:  # before rich, which may be the one missing
        fail("askonce demo", f"needs {', '.join(missing)}: pip install 'askonce[demo]' (or run "
             "'askonce demo --in-process', which needs nothing)", USAGE)
    out = opts.out or Path(f"askonce-report-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}")
    writable_dir("askonce demo", "--out", out)
    from rich.console import Console

    width = None if sys.stdout.isatty() else 132  # a pipe or file gets the whole table, unwrapped
    err = Console(stderr=True, width=width)
    if opts.redis is not None:
        why = check_redis(opts.redis)
        if why is not None:
            err.print(f"askonce demo: {why}")
            return 2
    console = err if opts.json else Console(width=width)
    chosen = {n: s for n, s in scenarios(opts.quick, opts.seed, opts.budget, opts.grace,
                                       opts.join, opts.breaker, opts.error_rates).items()
              if n in opts.scenarios or n not in SCENARIOS}  # the sweep's are always run
    plan = lanes(chosen)
    started = time.monotonic()
    from askonce.demo import measure, report
    from askonce.demo.stack import Stack, StackError

    pids: list[int] = []
    try:
        with contextlib.ExitStack() as stacks:
            group = [stacks.enter_context(Stack(out / "logs" / f"stack{i + 1}"))
                     for i in range(len(plan))]
            console.print(f"askonce demo: starting {4 * len(group)} processes on 127.0.0.1 "
                          f"(report: {out}/index.html)")
            for stack in group:
                stack.ready()
            runs = asyncio.run(_run_lanes(group, plan, opts, console))
            pids = [pid for stack in group for pid in stack.started]
    except StackError as exc:
        err.print(f"askonce demo: {exc}")
        return 1
    except KeyboardInterrupt:
        err.print("askonce demo: interrupted; every process it started has been stopped")
        return 130
    rows = [r.row for r in runs]
    goals = measure.goals(rows)
    meta = _meta(opts, out, pids, time.monotonic() - started, runs)
    # For a simulator to replay: a calibrated scenario as it was run.
    for row in rows:
        s = chosen.get(row["scenario"])
        if s is not None and "slow_s" in row:
            chosen[row["scenario"]] = dataclasses.replace(
                s, target=dataclasses.replace(s.target, slow_time=row["slow_s"]))
    meta["parameters"] = {name: dataclasses.asdict(s) for name, s in chosen.items()}
    doc = report.document(runs, goals, meta)
    page = report.write(out, runs, doc, chosen)
    if opts.json:
        print(json.dumps(doc, indent=2))
    else:
        report.print_table(console, runs, goals, meta)
        console.print(f"\nReport with plots: {page}   ({meta['elapsed_s']:.0f} s)")
    return 0


async def _run_lanes(group: list[Any], plan: list[list[tuple[Scenario, str]]], opts: Options,
                     console: Any) -> list[Any]:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    from askonce.demo.runner import Runner

    with Progress(TextColumn("{task.description:<20}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        tasks: dict[str, Any] = {}

        def tick(label: str, done: int, total: int) -> None:
            if label not in tasks:
                tasks[label] = progress.add_task(label, total=total)
            progress.update(tasks[label], completed=done, total=total)

        async def lane(stack: Any, runs: list[tuple[Scenario, str]]) -> list[Any]:
            runner = Runner(stack, seed=opts.seed, redis=opts.redis, tick=tick)
            out = []
            for i, (scenario, policy) in enumerate(runs):
                out.append(await runner.run(scenario, policy, settle=i < len(runs) - 1))
            return out

        results = await asyncio.gather(*(lane(s, r)
                                         for s, r in zip(group, plan, strict=True)))
    return [run for lane_runs in results for run in lane_runs]


def _meta(opts: Options, out: Path, pids: list[int], elapsed: float,
          runs: list[Any]) -> dict[str, Any]:
    notes = []
    for run in runs:
        r = run.row
        label = f"{r['scenario']} {r['policy']}"
        median = r.get("calibrated_median_ms")
        if median is not None and r["policy"] == "naive":
            notes.append(f"{r['scenario']}: slow arrivals took {1000 * r['slow_s']:,.0f} ms, "
                         f"{r['slow_factor']:g}x the stack's median answer of {median:.0f} ms "
                         "(measured first on fast calls only)")
        lag = r["launch_lag_ms"]["max"]
        if lag is not None and lag > 100:  # said; past measure.LAG_LIMIT_MS it invalidates
            notes.append(f"{label}: the load generator launched a question up to {lag:.0f} ms "
                         "late")
        if not r.get("settled", True):
            notes.append(f"{label}: the stack did not settle after the run and was restarted")
        errors = r["statuses"].get("500", 0)
        if errors:
            notes.append(f"{label}: {errors} questions ended in an internal error (HTTP 500): "
                         f"see {out}/logs")
        # Overload runs stop at their horizon by design.
        if r["unanswered"] and r["scenario"] != "overload":
            notes.append(f"{label}: {r['unanswered']} questions were still open at the end of "
                         "the run")
    return {
        "command": opts.command,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": f"{os.cpu_count()} CPUs, Python {platform.python_version()}, "
                   f"{platform.system()}",
        "quick": opts.quick, "seed": opts.seed, "budget": opts.budget, "grace": opts.grace,
        "join": opts.join, "breaker": opts.breaker,
        "redis": opts.redis is not None,
        "elapsed_s": round(elapsed, 1), "report_dir": str(out), "pids": pids, "notes": notes,
    }  # fmt: skip

