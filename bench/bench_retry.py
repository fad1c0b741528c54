"""What ``@askonce.retry`` costs per call, against tenacity, stamina and backoff in the same run.

Scenarios, sync and async: (a) the call succeeds at once; (b) it fails twice and then succeeds, every
library configured for zero waits (askonce ``backoff=NO_WAIT``; tenacity ``wait_none()``; stamina
``wait_initial=wait_max=wait_jitter=0``; backoff ``constant, interval=0, jitter=None``), 3 attempts each.
The overhead of a library is the time of a decorated call minus the time of the same work done bare
(one plain call; for (b) a plain ``for``/``try`` loop of three calls), measured in the same round;
the figure is the median over rounds, each round running every case interleaved. askonce is measured
with no question bound (the layer mints one per call) and inside a bound ``askonce.question()``.

It also checks that a zero wait never calls ``sleep``: with an injected sleep for askonce, and for every
library by counting calls of ``time.sleep`` / ``asyncio.sleep`` with a profile hook (nothing patched).

    python bench/bench_retry.py              # markdown tables, 20-30 s
    python bench/bench_retry.py --profile    # also: which calls one success-path call makes, and their cost
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import gc
import inspect
import os
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import backoff
import stamina
import tenacity

import askonce
from askonce.core.backoff import NO_WAIT

ATTEMPTS = 3
ON = ConnectionError
TARGET_SYNC_US = 1.0
TARGET_ASYNC_US = 1.5

# stamina's default hooks log (and count in Prometheus) every retry; the other libraries log nothing
# by default, so turn them off to compare the retry machinery itself.
stamina.instrumentation.set_on_retry_hooks([])


# --- the functions under test ---------------------------------------------------------------------


def ok() -> int:
    return 1


async def aok() -> int:
    return 1


class Flaky:
    """A counter of calls; ``.sync()`` and ``.async_()`` make functions that fail twice, then succeed."""

    def __init__(self) -> None:
        self.calls = 0

    def sync(self) -> Callable[[], int]:
        def flaky() -> int:
            self.calls += 1
            if self.calls % 3:
                raise ConnectionError("flaky")
            return 1

        return flaky

    def async_(self) -> Callable[[], Awaitable[int]]:
        async def aflaky() -> int:  # a real coroutine function: libraries tell sync from async by it
            self.calls += 1
            if self.calls % 3:
                raise ConnectionError("flaky")
            return 1

        return aflaky


def bare_retry(fn: Callable[[], int]) -> Callable[[], int]:
    """The same three tries, written by hand: the work every library has to do anyway."""

    def call() -> int:
        for i in range(ATTEMPTS):
            try:
                return fn()
            except ON:
                if i == ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    return call


def abare_retry(fn: Callable[[], Awaitable[int]]) -> Callable[[], Awaitable[int]]:
    async def call() -> int:
        for i in range(ATTEMPTS):
            try:
                return await fn()
            except ON:
                if i == ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    return call


Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


def decorators() -> dict[str, Decorator]:
    """Each library set up for 3 attempts on ConnectionError with zero waits."""
    return {
        "askonce": askonce.retry(on=ON, attempts=ATTEMPTS, layer="bench", backoff=NO_WAIT),
        "tenacity": tenacity.retry(stop=tenacity.stop_after_attempt(ATTEMPTS), wait=tenacity.wait_none(),
                                   retry=tenacity.retry_if_exception_type(ON), reraise=True),
        "stamina": stamina.retry(on=ON, attempts=ATTEMPTS, wait_initial=0, wait_max=0, wait_jitter=0),
        "backoff": backoff.on_exception(backoff.constant, ON, max_tries=ATTEMPTS, interval=0, jitter=None),
    }


# The per-target retry token bucket lets retries be 10 % of requests (plus 10/s): a call that always
# needs two retries is throttled by design. For (b) askonce runs with a bucket that earns 10 tokens a
# request (the full path, bucket included) and with no bucket.
FLAKY_ASKONCE: dict[str, Callable[[], askonce.retry]] = {
    "askonce": lambda: askonce.retry(on=ON, attempts=ATTEMPTS, layer="bench", backoff=NO_WAIT,
                                     bucket=askonce.BucketPolicy(ratio=10.0)),
    "askonce, bucket=None": lambda: askonce.retry(on=ON, attempts=ATTEMPTS, layer="bench",
                                                  backoff=NO_WAIT, bucket=None),
}


@dataclass
class Case:
    fn: Callable[[], Any]
    is_async: bool
    bound: bool = False  # run inside a bound askonce.question()
    flaky: Flaky | None = None  # the call counter of a failing function: checked before timing


def scenarios() -> dict[str, dict[str, Case]]:
    libs = decorators()

    def flaky_sync(wrap: Callable[[Callable[[], int]], Callable[[], Any]]) -> Case:
        f = Flaky()
        return Case(wrap(f.sync()), False, flaky=f)

    def flaky_async(wrap: Callable[[Callable[[], Awaitable[int]]], Callable[[], Any]]) -> Case:
        f = Flaky()
        return Case(wrap(f.async_()), True, flaky=f)

    out: dict[str, dict[str, Case]] = {
        "sync success": {"bare": Case(ok, False)},
        "async success": {"bare": Case(aok, True)},
        "sync 2 fails + success": {"bare": flaky_sync(bare_retry)},
        "async 2 fails + success": {"bare": flaky_async(abare_retry)},
    }
    for name, deco in libs.items():
        out["sync success"][name] = Case(deco(ok), False)
        out["async success"][name] = Case(deco(aok), True)
        if name == "askonce":
            out["sync success"]["askonce, question bound"] = Case(deco(ok), False, bound=True)
            out["async success"]["askonce, question bound"] = Case(deco(aok), True, bound=True)
            # Without the default adaptive admission: the retry layer's own cost.
            plain = askonce.retry(on=ON, attempts=ATTEMPTS, layer="bench", backoff=NO_WAIT,
                                  admission=None)
            out["sync success"]["askonce, admission=None"] = Case(plain(ok), False)
            out["async success"]["askonce, admission=None"] = Case(plain(aok), True)
            for label, make in FLAKY_ASKONCE.items():
                out["sync 2 fails + success"][label] = flaky_sync(make())
                out["async 2 fails + success"][label] = flaky_async(make())
        else:
            out["sync 2 fails + success"][name] = flaky_sync(deco)
            out["async 2 fails + success"][name] = flaky_async(deco)
    return out


# --- timing ---------------------------------------------------------------------------------------


def _bound(case: Case) -> contextlib.AbstractContextManager[Any]:
    return askonce.question(budget=2, deadline=30.0) if case.bound else contextlib.nullcontext()


Clock = Callable[[], int]
WALL: Clock = time.perf_counter_ns
CPU: Clock = time.thread_time_ns  # this thread's CPU time: blind to the time other processes take


@dataclass
class Result:
    wall: float  # median ns per call
    wall_over: float  # median of (ns per call - bare ns per call) in the same round
    cpu: float
    cpu_over: float


async def _aloop(case: Case, n: int) -> tuple[int, int]:
    fn = case.fn
    with _bound(case):
        c0, t0 = CPU(), WALL()
        for _ in range(n):
            await fn()
        t1, c1 = WALL(), CPU()
    return t1 - t0, c1 - c0


def _loop(case: Case, n: int, loop: asyncio.AbstractEventLoop) -> tuple[float, float]:
    """(wall ns, CPU ns) per call over ``n`` calls, the collector off (as ``timeit`` does)."""
    gc.collect()
    gc.disable()
    try:
        if case.is_async:
            wall, cpu = loop.run_until_complete(_aloop(case, n))
            return wall / n, cpu / n
        fn = case.fn
        with _bound(case):
            c0, t0 = CPU(), WALL()
            for _ in range(n):
                fn()
            t1, c1 = WALL(), CPU()
        return (t1 - t0) / n, (c1 - c0) / n
    finally:
        gc.enable()


def measure(cases: dict[str, Case], rounds: int, sample_ms: float,
            loop: asyncio.AbstractEventLoop) -> dict[str, Result]:
    """Medians over rounds; each round runs every case once, interleaved, so drift hits them alike."""
    sizes = {}
    for name, case in cases.items():
        per = min(_loop(case, 50, loop)[1] for _ in range(3))
        sizes[name] = max(50, int(sample_ms * 1e6 / max(per, 1.0)))
    wall: dict[str, list[float]] = {name: [] for name in cases}
    cpu: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, case in cases.items():
            w, c = _loop(case, sizes[name], loop)
            wall[name].append(w)
            cpu[name].append(c)
    med = statistics.median
    return {name: Result(med(wall[name]), med([a - b for a, b in zip(wall[name], wall["bare"], strict=True)]),
                         med(cpu[name]), med([a - b for a, b in zip(cpu[name], cpu["bare"], strict=True)]))
            for name in cases}


# --- premises and sleep counting --------------------------------------------------------------------


def check_premises(all_cases: dict[str, dict[str, Case]], loop: asyncio.AbstractEventLoop) -> None:
    """Every decorated function returns, and the flaky ones make exactly 3 calls per decorated call."""
    for scenario, cases in all_cases.items():
        for name, case in cases.items():
            flaky = case.flaky
            assert (flaky is not None) == ("fails" in scenario), (scenario, name)
            before = flaky.calls if flaky else 0
            for _ in range(10):
                with _bound(case):
                    result = loop.run_until_complete(case.fn()) if case.is_async else case.fn()
                assert result == 1, (scenario, name, result)
            if flaky is not None:
                assert flaky.calls - before == 30, (scenario, name, flaky.calls - before)


class SleepCounter:
    """Counts calls of ``time.sleep`` and ``asyncio.sleep`` with a profile hook: nothing is patched.

    A coroutine's frame reports a "call" event on every resume, so async sleeps are counted as
    distinct frames.
    """

    def __init__(self) -> None:
        self.sync = 0
        self._frames: set[FrameType] = set()
        self._asleep = asyncio.sleep.__code__

    @property
    def async_(self) -> int:
        return len(self._frames)

    def _hook(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "c_call" and arg is time.sleep:
            self.sync += 1
        elif event == "call" and frame.f_code is self._asleep:
            self._frames.add(frame)

    def __enter__(self) -> SleepCounter:
        sys.setprofile(self._hook)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)


def count_sleeps(loop: asyncio.AbstractEventLoop, calls: int = 200) -> list[tuple[str, str, str]]:
    """Sleep calls per decorated call in scenario (b), sync and async, for every library."""
    rows: list[tuple[str, str, str]] = []

    # askonce with an injected sleep: the documented way to observe it, and a control that waits
    # 1 us (sleep must then be called twice a call, or the counter proves nothing).
    injected: list[float] = []

    async def asleep(s: float) -> None:
        injected.append(s)

    for label, wait in (("askonce, injected sleep, NO_WAIT", NO_WAIT),
                        ("control: askonce, injected sleep, 1 us waits",
                         askonce.Backoff(base=1e-6, cap=1e-6, jitter=False))):
        injected.clear()
        f = askonce.retry(on=ON, layer="bench", backoff=wait, bucket=None, sleep=injected.append)(Flaky().sync())
        for _ in range(calls):
            f()
        n_sync = len(injected)
        injected.clear()
        af = askonce.retry(on=ON, layer="bench", backoff=wait, bucket=None, sleep=asleep)(Flaky().async_())

        async def drive(fn: Callable[[], Awaitable[int]] = af) -> None:
            for _ in range(calls):
                await fn()

        loop.run_until_complete(drive())
        rows.append((label, f"{n_sync / calls:g}", f"{len(injected) / calls:g}"))

    sync_fns: dict[str, Callable[[], int]] = {"askonce": FLAKY_ASKONCE["askonce, bucket=None"]()(Flaky().sync())}
    async_fns: dict[str, Callable[[], Awaitable[int]]] = {
        "askonce": FLAKY_ASKONCE["askonce, bucket=None"]()(Flaky().async_())}
    for name, deco in decorators().items():
        if name != "askonce":
            sync_fns[name] = deco(Flaky().sync())
            async_fns[name] = deco(Flaky().async_())
    for name in sync_fns:
        with SleepCounter() as c:
            for _ in range(calls):
                sync_fns[name]()
        n_sync = c.sync

        async def adrive(fn: Callable[[], Awaitable[int]] = async_fns[name]) -> None:
            for _ in range(calls):
                await fn()

        with SleepCounter() as c:
            loop.run_until_complete(adrive())
        rows.append((f"{name} (profile hook)", f"{n_sync / calls:g}", f"{c.async_ / calls:g}"))
    return rows


# --- where the time goes (--profile) ----------------------------------------------------------------


def trace_one_call(fn: Callable[[], Any], bound: bool) -> list[str]:
    """Every Python function and C function one decorated call runs (``sys.setprofile``)."""
    events: list[str] = []

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            events.append(f"{code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno} {code.co_qualname}")
        elif event == "c_call":
            events.append(f"C {getattr(arg, '__qualname__', arg)}")

    with _bound(Case(fn, False, bound)):
        fn()  # warm: the token bucket handle is made on the first call
        sys.setprofile(hook)
        fn()
        sys.setprofile(None)
    return [e for e in events if not e.endswith("setprofile")]


def _ns(stmt: Callable[[], object], n: int = 200_000, repeat: int = 7) -> float:
    """The best of ``repeat`` loops: for one operation alone, noise only ever adds time."""
    best = []
    for _ in range(repeat):
        gc.disable()
        t0 = CPU()
        for _ in range(n):
            stmt()
        best.append((CPU() - t0) / n)
        gc.enable()
    return min(best)


def primitives() -> list[tuple[str, str, float]]:
    """Each operation the success path is made of, alone: (operation, its line in ``call``, ns).

    Every operation runs inside a lambda and what it is compared with (an empty lambda, or the same
    call without the operation) is subtracted, so C calls and Python calls are measured alike. The
    line is found by searching the source of ``_sync_wrapper`` from ``def call(`` on.
    """
    from askonce._context import FRAME as _frame
    from askonce.core.question import Account, Hop, Tab
    from askonce.stores.memory import MemoryStore

    store = MemoryStore(time.monotonic)
    handle = store.bucket("bench", askonce.BucketPolicy())
    path = (Hop("a", 1),)
    first = (Hop("bench", 1),)
    tab = Tab("k" * 36, "bench", False, Account(2), None)
    get, set_, reset = _frame.get, _frame.set, _frame.reset

    def wrapper(*args: Any, **kwargs: Any) -> int:
        return ok(*args, **kwargs)

    def plain() -> int:
        return ok()

    def try_finally() -> int:
        try:
            return ok()
        finally:
            pass

    def nothing() -> None:
        return None

    # (operation, a snippet of its line in ``call``, the operation, what to subtract from it)
    ops: list[tuple[str, str, Callable[[], object], Callable[[], object]]] = [
        ("calling the wrapped function (the bare baseline)", "return fn(", lambda: ok(), nothing),
        ("the decorator's own frame: `call(*args, **kwargs)` -> `fn(*args, **kwargs)`", "def call(",
         lambda: wrapper(), lambda: ok()),
        ("`try`/`finally` around the call", "try:", lambda: try_finally(), lambda: plain()),
        ("`ContextVar.get()`", "get()", lambda: get(), nothing),
        ("`Account(budget)`", "Account(", lambda: Account(2), nothing),
        ("`Tab(None, layer, originator, Account(budget), deadline, minter)`, Account included", "Tab(",
         lambda: Tab(None, "bench", False, Account(2), 30.0, askonce.propagation.new_key), nothing),
        ("`clock()` (time.monotonic)", "clock()", lambda: time.monotonic(), nothing),
        ("`bucket.deposit()`", "deposit()", lambda: handle.deposit(), nothing),
        ("`(tab, path + first)`: tuple concat and the frame tuple", "path + first", lambda: (tab, path + first),
         nothing),
        ("`ContextVar.set()` + `reset()`", "set_(", lambda: reset(set_((tab, path))), nothing),
    ]
    with contextlib.suppress(ImportError):
        from askonce.core.retry import RetryPolicy, fits  # type: ignore[attr-defined, unused-ignore]

        policy = RetryPolicy()
        ops.append(("`fits(policy, tab.deadline, clock())`, clock included (question bound only)", "fits(",
                    lambda: fits(policy, 1e12, time.monotonic()), nothing))
    lines, start = inspect.getsourcelines(askonce.retry._sync_wrapper)
    body = next((i for i, line in enumerate(lines) if "def call(" in line), 0)  # the success path only
    out = []
    for label, snippet, op, base in ops:
        where = next((str(start + i) for i, line in enumerate(lines) if i >= body and snippet in line), "-")
        out.append((label, where, max(0.0, _ns(op) - _ns(base))))
    return out


def profile_report() -> str:
    deco = askonce.retry(on=ON, layer="bench")
    sync_fn = deco(ok)
    lines = ["### Where the askonce success-path time goes", ""]
    src = inspect.getsourcefile(askonce.retry) or "retrying.py"
    lines.append(f"Calls made by one successful sync call (`sys.setprofile`), from `{src.rsplit('/src/', 1)[-1]}`:")
    lines.append("")
    for bound in (False, True):
        trace = trace_one_call(sync_fn, bound)
        lines.append(f"- {'question bound' if bound else 'no question bound'}: " + ", ".join(f"`{e}`" for e in trace))
    lines += ["", "Each operation timed alone (CPU time, best of 7 x 200k, minus what it is compared with):", "",
              "| operation | first line in retrying.py | ns |", "|---|---:|---:|"]
    lines += [f"| {label} | {where} | {ns:,.0f} |" for label, where, ns in primitives()]
    return "\n".join(lines)


# --- report -----------------------------------------------------------------------------------------


def _us(ns: float) -> str:
    return f"{ns / 1000:.2f}"


def run(rounds: int, sample_ms: float, profile: bool) -> str:
    load_before = os.getloadavg()[0]
    loop = asyncio.new_event_loop()
    try:
        all_cases = scenarios()
        check_premises(all_cases, loop)
        results = {scenario: measure(cases, rounds, sample_ms, loop) for scenario, cases in all_cases.items()}
        sleeps = count_sleeps(loop)
    finally:
        loop.close()
    load_after = os.getloadavg()[0]

    names = ["askonce", "askonce, question bound", "askonce, admission=None", "askonce, bucket=None", "tenacity",
             "stamina", "backoff"]
    cols = list(results)
    head = ["| library | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    versions = (f"tenacity {_version('tenacity')}, stamina {_version('stamina')}, "
                f"backoff {_version('backoff')}")
    lines = [
        "### Retry overhead per call (µs): decorated call minus the same work done bare",
        "",
        f"{datetime.date.today().isoformat()}, Python {platform.python_version()}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs, load average {load_before:.1f} -> {load_after:.1f}; askonce {askonce.__version__}, "
        f"{versions}. Median of {rounds} interleaved rounds of ~{sample_ms:.0f} ms per case.",
        "",
        "Wall clock (`time.perf_counter_ns`):",
        "",
        *head,
    ]
    for name in names:
        cells = [_us(results[c][name].wall_over) if name in results[c] else "n/a" for c in cols]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("| *bare call (total, not overhead)* | " + " | ".join(_us(results[c]["bare"].wall) for c in cols)
                 + " |")
    lines += ["", "The same calls in CPU time of the benchmark thread (`time.thread_time_ns`: blind to other "
              "processes on a loaded machine):", "", *head]
    for name in names:
        cells = [_us(results[c][name].cpu_over) if name in results[c] else "n/a" for c in cols]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Peer overhead divided by askonce's (no question bound), wall clock, same run:", "",
              "| peer | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for peer in ("tenacity", "stamina", "backoff"):
        cells = [f"{results[c][peer].wall_over / results[c]['askonce'].wall_over:.1f}x" for c in cols]
        lines.append(f"| {peer} / askonce | " + " | ".join(cells) + " |")

    lines += ["", "Sleep calls per call in the 2-fails scenario, zero waits configured:", "",
              "| what | sync | async |", "|---|---:|---:|"]
    lines += [f"| {what} | {s} | {a} |" for what, s, a in sleeps]

    def verdict(ok_: bool) -> str:
        return "pass" if ok_ else "**FAIL**"

    zero = all(r[1] == r[2] == "0" for r in sleeps if r[0].startswith("askonce"))
    control = sleeps[1][1] == sleeps[1][2] == "2"
    lines += ["", "| target (issue 2) | wall | CPU | result (wall / CPU) |", "|---|---:|---:|---|"]
    for scenario, target in (("sync success", TARGET_SYNC_US), ("async success", TARGET_ASYNC_US)):
        for label, key in (("no question bound", "askonce"), ("question bound", "askonce, question bound"),
                           ("admission=None", "askonce, admission=None")):
            r = results[scenario][key]
            w, c = r.wall_over / 1000, r.cpu_over / 1000
            lines.append(f"| {scenario} overhead <= {target} µs, {label} | {w:.2f} µs | {c:.2f} µs "
                         f"| {verdict(w <= target)} / {verdict(c <= target)} |")
    lines.append(f"| a zero wait never calls sleep | 0 calls (control: 2) | | {verdict(zero and control)} |")
    if profile:
        lines += ["", profile_report()]
    return "\n".join(lines)


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--sample-ms", type=float, default=20.0)
    ap.add_argument("--profile", action="store_true", help="also show where the success-path time goes")
    args = ap.parse_args(argv)
    print(run(args.rounds, args.sample_ms, args.profile))
    return 0


if __name__ == "__main__":
    sys.exit(main())
