"""CPU seconds per question of the demo's real stack, naive against askonce, same run.

Starts the demo's four processes (``askonce.demo.stack.Stack``: gateway and service FastAPI under
uvicorn, the API Flask under waitress, the Starlette target) and runs one of its scenarios through
the demo's own runner (``askonce.demo.runner.Runner``: configure, load from the edge in this
process, wait until quiet), once per policy per round, alternating the order each round. Around
every run (configuring, the load, and the wait for orphaned work; not the settling after it) it
reads each process's CPU time (utime + stime, every thread) from ``/proc/<pid>/stat``, and this
process's own (the edge, with the runner's few control calls), and divides by the questions
asked. Figures: CPU ms per question per process, for the stack (the four
servers) and with the edge, and askonce against the naive run of the same round (median over
rounds, and the range). Beside them, the share of questions answered in time and the p50 latency,
which say whether a stack kept up with the load (a collapsing stack does other work per question),
and the TCP connections opened per question to the stack's ports (the sockets in
``/proc/net/tcp`` after the run that were not there before, TIME-WAIT included: a run is shorter
than the 60 s a closed connection stays there): a request cut off by a timeout or a cancellation
costs its keep-alive connection, and a new one later. And the stack's sleeps per question: the
voluntary context switches of the four processes (every thread), each an event loop or a thread
woken from waiting, by a socket or a timer.

``--pieces``: no processes; each layer's code called in this process on stub transports (no sockets,
no server), naive, askonce, and askonce without one piece at a time (the join middleware, the
askonce client, the breaker), to tell what each piece costs. ``--no-join``: also askonce with the
scenario's ``join=False`` (no join middlewares), to tell their share; ``--grace SECONDS``: also
askonce with that ``deadline_grace`` (a callee's answer at its deadline then reaches a caller still
waiting, on the same connection). ``--compare SRC``: a second stack whose processes import askonce
from ``SRC`` (another checkout's ``src``), run with askonce in the same rounds: before and after a
change, on the same load at the same moments. The edge always runs this process's askonce.

    PYTHONPATH=src python bench/bench_stack_cpu.py                       # transient, 150 q/s, ~3 min
    PYTHONPATH=src python bench/bench_stack_cpu.py --rounds 5 --duration 10
    PYTHONPATH=src python bench/bench_stack_cpu.py --compare /tmp/askonce-before/src
    PYTHONPATH=src python bench/bench_stack_cpu.py --rate 60                # below saturation
    PYTHONPATH=src python bench/bench_stack_cpu.py --pieces --rounds 15     # in-process, ~1 min
    python bench/bench_stack_cpu.py --wakeup-cost                           # one idle wakeup, ~10 s

The child processes import askonce from ``PYTHONPATH`` (set it to this checkout's ``src`` when
askonce is installed from another one).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

import askonce
from askonce.demo.params import scenarios
from askonce.demo.runner import Runner
from askonce.demo.stack import CHAIN, Stack

TICK = os.sysconf("SC_CLK_TCK")
ROUNDS = 3
DURATION = 10.0  # seconds of load per run


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system, all threads) of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime (fields 14, 15)


def connections(stack: Stack) -> set[tuple[str, str]]:
    """The TCP sockets (any state, TIME-WAIT included) connected to a port of the stack."""
    ports = {int(proc.url.rsplit(":", 1)[1]) for proc in stack.procs.values() if proc.url}
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.readlines()[1:]:
                local, remote = line.split()[1:3]
                if int(remote.rsplit(":", 1)[1], 16) in ports:
                    out.add((local, remote))
    return out


def self_cpu() -> float:
    t = os.times()
    return t.user + t.system


@contextlib.contextmanager
def pythonpath(src: str | None) -> Iterator[None]:
    """``PYTHONPATH`` for the processes a stack spawns meanwhile."""
    old = os.environ.get("PYTHONPATH")
    if src is not None:
        os.environ["PYTHONPATH"] = src
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def switches(pid: int) -> int:
    """Context switches of a process so far, every thread: voluntary ones are its sleeps (an event
    loop woken by a timer or a socket), the others its preemptions."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/status") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches"):
                    total += int(line.split()[1])
    return total


def snapshot(stack: Stack) -> dict[str, float]:
    out = {name: proc_cpu(stack.procs[name].popen.pid) for name in CHAIN}
    out["edge"] = self_cpu()
    return out


async def one_run(runner: Runner, scenario: Any, policy: str) -> dict[str, Any]:
    """One run, its CPU counted from the first question to the end of the quiet wait (orphaned
    work included), the settling after it not (a stack that does not settle is restarted)."""
    stack = runner.stack
    pids = [stack.procs[name].popen.pid for name in CHAIN]
    before, t0, known = snapshot(stack), time.monotonic(), connections(stack)
    slept = sum(switches(pid) for pid in pids)
    run = await runner.run(scenario, policy, settle=False)
    after, wall = snapshot(stack), time.monotonic() - t0
    slept = sum(switches(pid) for pid in pids) - slept
    opened = len(connections(stack) - known)  # a closed one stays in TIME-WAIT for 60 s
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as control:
        settled = await runner.settle(control)
    if not settled:
        await asyncio.get_running_loop().run_in_executor(None, stack.restart)
    row = run.row
    n = row["questions"]
    cpu = {k: 1000.0 * (after[k] - before[k]) / n for k in after}  # ms per question
    cpu["stack"] = sum(cpu[k] for k in CHAIN)
    cpu["all"] = cpu["stack"] + cpu["edge"]
    return {"policy": policy, "cpu": cpu, "questions": n, "wall_s": wall,
            "ok": row["success_rate"], "p50": row["latency_ms"]["p50"],
            "opened": opened / n, "woken": slept / n, "settled": settled,
            "load": os.getloadavg()[0]}


async def bench(args: argparse.Namespace) -> list[list[dict[str, Any]]]:
    scenario = scenarios(seed=args.seed)[args.scenario]
    scenario = replace(scenario, duration=args.duration,
                       rate=args.rate if args.rate is not None else scenario.rate)
    # (label, stack, scenario, policy)
    cases: list[tuple[str, str, Any, str]] = [("naive", "main", scenario, "naive"),
                                              ("askonce", "main", scenario, "askonce")]
    if args.no_join:
        cases.append(("askonce, no join", "main", replace(scenario, join=False), "askonce"))
    if args.grace is not None:
        cases.append((f"askonce, grace {args.grace:g} s", "main", replace(scenario, grace=args.grace),
                      "askonce"))
    with contextlib.ExitStack() as stacks:
        main = stacks.enter_context(Stack())
        runners = {"main": Runner(main, seed=args.seed)}
        if args.compare is not None:
            with pythonpath(args.compare):
                other = stacks.enter_context(Stack())
            runners["compare"] = Runner(other, seed=args.seed)
            cases.append((f"askonce ({args.compare})", "compare", scenario, "askonce"))
        for stack in {id(r.stack): r.stack for r in runners.values()}.values():
            stack.ready()
        # A warm-up run of each case: imports, pools and caches are not charged to the first.
        for _, where, sc, policy in cases:
            await runners[where].run(replace(sc, duration=min(2.0, args.duration)), policy)
        rounds = []
        for i in range(args.rounds):
            order = cases if i % 2 == 0 else cases[::-1]
            results = {}
            for label, where, sc, policy in order:
                r = await one_run(runners[where], sc, policy)
                r["case"] = label
                results[label] = r
                print(f"round {i + 1}: {label:<12} {r['cpu']['stack']:.2f} ms/q stack, "
                      f"{r['cpu']['edge']:.2f} edge, ok {100 * (r['ok'] or 0):.1f} %, "
                      f"p50 {r['p50'] or 0:.0f} ms, {r['opened']:.2f} connections/q, "
                      f"load {r['load']:.1f}", file=sys.stderr)
            rounds.append([results[c[0]] for c in cases])
    return rounds


def fmt_range(values: list[float], spec: str) -> str:
    med = statistics.median(values)
    return f"{med:{spec}} ({min(values):{spec}}..{max(values):{spec}})"


def table(rounds: list[list[dict[str, Any]]], args: argparse.Namespace) -> str:
    cols = [*CHAIN, "stack", "edge", "all"]
    lines = [
        f"## The demo's stack: CPU per question, {args.scenario} at "
        f"{args.rate or scenarios()[args.scenario].rate:g} q/s for {args.duration:g} s, "
        f"{len(rounds)} rounds",
        "",
        f"{datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, askonce from {Path(askonce.__file__).parent}; "
        f"load average {', '.join(f'{x:.1f}' for x in os.getloadavg())}",
        "",
        "CPU ms per question, median over rounds (min..max); the ratio is each round's askonce "
        "over that round's naive.",
        "",
        "| case | " + " | ".join(cols) + " | answered in time | p50 ms | connections opened per q "
        "| stack's sleeps per q |",
        "|---|" + "---:|" * (len(cols) + 4),
    ]
    for j, first in enumerate(rounds[0]):
        runs = [r[j] for r in rounds]
        cells = [fmt_range([run["cpu"][c] for run in runs], ".2f") for c in cols]
        ok = fmt_range([100 * (run["ok"] or 0) for run in runs], ".1f")
        p50 = fmt_range([run["p50"] or 0 for run in runs], ".0f")
        opened = fmt_range([run["opened"] for run in runs], ".2f")
        woken = fmt_range([run["woken"] for run in runs], ".2f")
        lines.append(f"| {first['case']} | " + " | ".join(cells)
                     + f" | {ok} % | {p50} | {opened} | {woken} |")
        if j > 0:
            ratios = [fmt_range([100 * (r[j]["cpu"][c] / r[0]["cpu"][c] - 1)
                                 if r[0]["cpu"][c] else 0.0 for r in rounds], "+.1f") + " %"
                      for c in cols]
            lines.append(f"| {first['case']} vs naive | " + " | ".join(ratios) + " | | | | |")
    unsettled = sum(1 for r in rounds for run in r if not run["settled"])
    if unsettled:
        lines += ["", f"{unsettled} runs did not settle within the runner's time (their stack was "
                  "restarted after them, outside the CPU counted)."]
    return "\n".join(lines)


# --- --pieces: the demo's layers in-process, on stub transports, without each piece in turn -------


def _pieces(n: int, rounds: int) -> str:
    """CPU µs per request of each layer's code in this process (no sockets, no server): naive,
    askonce, and askonce without one piece at a time, so that each piece's share shows."""
    import gc
    import io
    import random

    import requests
    from requests.adapters import HTTPAdapter

    from askonce.core import wire
    from askonce.core.question import Hop, mint_key
    from askonce.demo import layer_asgi, layer_wsgi, target
    from askonce.demo.params import LayerSettings, TargetSettings
    from askonce.integrations.httpx import AsyncAskonceTransport

    rng = random.Random(1)
    keys = [wire.format_question(mint_key(1_700_000_000_000 + i, rng.randbytes(16)), "edge", True,
                                 3, 2.5, (Hop("edge", 1),)) for i in range(n)]
    reply = [(b"content-type", b"text/plain"), (b"content-length", b"3"),
             (b"askonce-reply", b"v=1, b=3")]

    class Stub(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            return httpx.Response(200, headers=reply, content=b"ok\n")

    def stub_send(self: Any, request: Any, **kwargs: Any) -> requests.Response:
        r = requests.Response()
        r.status_code, r.raw, r.url, r.request = 200, io.BytesIO(b"ok\n"), request.url, request
        r.headers = requests.structures.CaseInsensitiveDict({k.decode(): v.decode() for k, v in reply})
        return r

    def scope(mode: str, key: str) -> dict[str, Any]:
        name = b"askonce-question" if mode == "askonce" else b"x-question-id"
        return {"type": "http", "http_version": "1.1", "method": "GET", "scheme": "http",
                "path": "/q", "raw_path": b"/q", "query_string": b"", "root_path": "",
                "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 50000),
                "headers": [(b"host", b"127.0.0.1:8000"), (b"accept", b"*/*"),
                            (name, key.encode())]}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Any) -> None:
        return None

    async def asgi_layer(name: str, mode: str, join: bool = True, breaker: bool = True,
                         mw: bool = True, client: bool = True) -> Any:
        layer = layer_asgi.Layer(name)
        await layer.configure(LayerSettings(mode=mode, downstream="http://stub", join=join,
                                            breaker=mode == "askonce" and breaker))
        for c in layer.clients:
            askonce_client = mode == "askonce" and client
            c._transport = (AsyncAskonceTransport(Stub(), policy=c._transport.caller.policy,
                                                  store=c._transport.caller.store)
                            if askonce_client else Stub())
        if mode == "askonce" and not mw:
            layer.askonce_app = layer.askonce_app.app
        return layer

    async def the_target(mode: str, join: bool = True) -> Any:
        t = target.Target()
        t.settings = TargetSettings(mode=mode, service_time=0.0, slots=64, join=join)
        t.reset()
        return t

    async def time_asgi(app: Any, mode: str) -> float:
        for key in keys[:100]:
            await app(scope(mode, key), receive, send)
        gc.collect()
        gc.disable()  # the collector's pauses land in one case or another: timed without
        try:
            t0 = time.process_time()
            for key in keys:
                await app(scope(mode, key), receive, send)
            return (time.process_time() - t0) / n * 1e6
        finally:
            gc.enable()

    def time_wsgi(mode: str, join: bool = True, mw: bool = True) -> float:
        api = layer_wsgi.Api()
        api.configure(LayerSettings(mode=mode, downstream="http://stub", join=join))
        if mode == "askonce" and not mw:
            api.askonce_app = api.askonce_app.app
        header = "HTTP_ASKONCE_QUESTION" if mode == "askonce" else "HTTP_X_QUESTION_ID"

        def one(key: str) -> None:
            environ = {"REQUEST_METHOD": "GET", "PATH_INFO": "/q", "QUERY_STRING": "",
                       "SERVER_NAME": "127.0.0.1", "SERVER_PORT": "8000",
                       "SERVER_PROTOCOL": "HTTP/1.1", "wsgi.url_scheme": "http",
                       "wsgi.input": io.BytesIO(b""), "wsgi.errors": sys.stderr,
                       "wsgi.multithread": True, "wsgi.multiprocess": False,
                       "wsgi.run_once": False, "HTTP_HOST": "127.0.0.1:8000", header: key}
            body = api(environ, lambda status, headers, exc_info=None: None)
            for _ in body:
                pass
            getattr(body, "close", lambda: None)()

        for key in keys[:100]:
            one(key)
        gc.collect()
        gc.disable()
        try:
            t0 = time.process_time()
            for key in keys:
                one(key)
            return (time.process_time() - t0) / n * 1e6
        finally:
            gc.enable()

    async def asgi(name: str, mode: str, **kw: Any) -> float:
        app = await (the_target(mode, **kw) if name == "target" else asgi_layer(name, mode, **kw))
        return await time_asgi(app, mode)

    cases: list[tuple[str, str, Any]] = []
    for name in ("gateway", "service"):
        cases += [(name, "naive", lambda nm=name: asgi(nm, "naive")),
                  (name, "askonce", lambda nm=name: asgi(nm, "askonce")),
                  (name, "without the join middleware", lambda nm=name: asgi(nm, "askonce",
                                                                             join=False)),
                  (name, "... and without the askonce client (a plain transport)",
                   lambda nm=name: asgi(nm, "askonce", join=False, client=False))]
    cases.insert(6, ("service", "without the breaker", lambda: asgi("service", "askonce",
                                                                    breaker=False)))
    cases += [("api", "naive", lambda: time_wsgi("naive")),
              ("api", "askonce", lambda: time_wsgi("askonce")),
              ("api", "without the join middleware", lambda: time_wsgi("askonce", join=False)),
              ("target", "naive", lambda: asgi("target", "naive")),
              ("target", "askonce", lambda: asgi("target", "askonce")),
              ("target", "without the join middleware", lambda: asgi("target", "askonce",
                                                                      join=False))]
    original = HTTPAdapter.send
    HTTPAdapter.send = stub_send  # type: ignore[method-assign]
    try:
        out: dict[tuple[str, str], list[float]] = {(c[0], c[1]): [] for c in cases}

        async def all_rounds() -> None:
            for _ in range(rounds):
                for name, label, fn in cases:
                    value = fn()
                    out[(name, label)].append(await value if asyncio.iscoroutine(value)
                                              else value)

        asyncio.run(all_rounds())
    finally:
        HTTPAdapter.send = original  # type: ignore[method-assign]
    lines = [f"## The demo's layers in-process (stub transports, no sockets, the collector off), "
             f"{n} requests per case and round, {rounds} rounds", "",
             "CPU µs per request: median over rounds; over naive: the median of each round's "
             "difference to that round's naive of the same layer (min..max).", "",
             "| layer | case | CPU µs per request | over naive |", "|---|---|---:|---:|"]
    for name, label, _ in cases:
        med = statistics.median(out[(name, label)])
        diffs = [v - b for v, b in zip(out[(name, label)], out[(name, "naive")], strict=True)]
        over = "" if label == "naive" else fmt_range(diffs, "+.1f")
        lines.append(f"| {name} | {label} | {med:.1f} | {over} |")
    return "\n".join(lines)


def wakeup_cost(seconds: float = 2.0, every: float = 0.002, rounds: int = 3) -> str:
    """Process CPU of an event loop woken by a timer that finds nothing to do, against the same
    loop asleep: what a timer left armed past a request's end costs an idle server."""

    async def run() -> list[tuple[float, float, int]]:
        loop = asyncio.get_running_loop()
        out = []
        for _ in range(rounds):
            c0 = time.process_time()
            await asyncio.sleep(seconds)
            idle = time.process_time() - c0
            fired = 0
            handle: asyncio.TimerHandle | None = None

            def tick() -> None:
                nonlocal fired, handle
                fired += 1
                handle = loop.call_later(every, tick)

            c0 = time.process_time()
            handle = loop.call_later(every, tick)
            await asyncio.sleep(seconds)
            woken = time.process_time() - c0
            handle.cancel()
            out.append((idle, woken, fired))
        return out

    results = asyncio.run(run())
    each = [(woken - idle) / fired * 1e6 for idle, woken, fired in results if fired]
    return (f"An idle event loop woken every {every * 1000:g} ms by a timer that does nothing: "
            f"{statistics.median(each):.1f} µs of process CPU per wakeup (median of {rounds} runs "
            f"of {seconds:g} s; {min(each):.1f}..{max(each):.1f}).")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", default="transient", choices=("transient", "slow", "outage"))
    ap.add_argument("--rate", type=float, default=None, help="questions per second "
                    "(default: the scenario's)")
    ap.add_argument("--duration", type=float, default=DURATION)
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--compare", metavar="SRC", help="also askonce from another checkout's src")
    ap.add_argument("--grace", type=float, metavar="SECONDS",
                    help="also askonce with this deadline_grace at every client (the demo's --grace)")
    ap.add_argument("--no-join", action="store_true",
                    help="also askonce without the join middlewares (the scenario's join=False)")
    ap.add_argument("--pieces", action="store_true",
                    help="instead: each layer's code in-process on stub transports, per piece")
    ap.add_argument("--wakeup-cost", action="store_true",
                    help="instead: the CPU of one idle event loop's wakeup by a timer")
    args = ap.parse_args(argv)
    if args.wakeup_cost:
        print(wakeup_cost())
        return 0
    if args.pieces:
        print(_pieces(1000, args.rounds))
        return 0
    rounds = asyncio.run(bench(args))
    print(table(rounds, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
