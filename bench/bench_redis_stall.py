"""A stalled Redis under load: what each call pays and what a dead target gets, around a freeze.

    python bench/bench_redis_stall.py                      # 20 processes, a 5 s freeze, ~30 s
    python bench/bench_redis_stall.py --processes 8 --freeze 3

Starts its own redis-server on a free loopback port, then N worker processes. Each loops (one call
every ``--interval`` seconds) calling a ``@askonce.retry(store=RedisStore(url), breaker=...)``
function whose body is a dead target: it always raises ``ConnectionError`` and counts its arrivals.
The decorator's other protections are the defaults (3 attempts, the retry bucket, adaptive
admission), all in the one Redis; its backoff sleep is replaced by a no-op so that a call's wall
time is askonce's own work plus its store round trips. After a warm-up (the shared breaker opens)
the server is frozen with SIGSTOP for ``--freeze`` seconds (it accepts connections and never
answers), then resumed with SIGCONT.

Per call (``time.perf_counter`` around the whole decorated call): max and p99 before, during and
after the freeze, and the first call each process starts after SIGCONT. Per phase: the dead
target's arrivals per second, summed over the processes. Ratios: arrivals during the freeze (local
fallback) over arrivals before it (shared state), and the worst call over the documented bound
(``RedisStore``'s ``op_timeout``, 50 ms). The machine's load average is printed with the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

BOUND = 0.05  # RedisStore's default op_timeout: the documented bound on a store call
PHASES = ("before", "during", "after")
RECONNECT = 1.5  # s: the store tries Redis again within retry_after (1 s) of the last failure


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def start_redis(directory: str, port: int) -> subprocess.Popen[bytes]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (Debian: apt-get install redis-server)")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", directory, "--daemonize", "no", "--loglevel", "warning", "--databases", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while not ping(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"redis-server did not start on port {port}")
        time.sleep(0.01)
    return proc


def stop_redis(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGCONT)  # a frozen server must be able to die
        proc.kill()
    proc.wait(timeout=10)


def phase_of(t: float, freeze_at: float, resume_at: float) -> str:
    return "before" if t < freeze_at else "during" if t < resume_at else "after"


def worker(url: str, schedule: Any, go: Any, interval: float, results: Any) -> None:
    """Call the dead target through askonce until ``end``; send back what each phase saw."""
    import askonce
    from askonce import BreakerPolicy
    from askonce.stores.redis import RedisStore

    results.put("ready")  # imported: the schedule starts once every worker is
    go.wait()
    measure_at, freeze_at, resume_at, end = schedule[:]
    arrivals = dict.fromkeys(PHASES, 0)
    latencies: dict[str, list[float]] = {p: [] for p in PHASES}
    first_after: float | None = None
    slow: list[tuple[float, float]] = []  # (seconds since SIGSTOP, call seconds) over BOUND
    settle = 0.0  # the worst call in the first RECONNECT seconds after SIGCONT

    @askonce.retry(store=RedisStore(url), target="dead",
                   breaker=BreakerPolicy(failure_rate=0.5, minimum_calls=20),
                   sleep=lambda _s: None)
    def call_dead_target() -> None:
        now = time.time()
        if now >= measure_at:
            arrivals[phase_of(now, freeze_at, resume_at)] += 1
        raise ConnectionError("the dead target")

    calls = 0
    while (started := time.time()) < end:
        t0 = time.perf_counter()
        with contextlib.suppress(Exception):
            call_dead_target()
        dt = time.perf_counter() - t0
        calls += 1
        if started >= measure_at:
            phase = phase_of(started, freeze_at, resume_at)
            latencies[phase].append(dt)
            if dt > BOUND:
                slow.append((started - freeze_at, dt))
            if phase == "after" and first_after is None:
                first_after = dt
            if phase == "after" and started < resume_at + RECONNECT:
                settle = max(settle, dt)
        time.sleep(interval)
    stats = {k: v for k, v in askonce.stats().items() if k.startswith("store.redis.")}
    results.put({"arrivals": arrivals, "latencies": latencies, "first_after": first_after,
                 "settle": settle, "slow": slow, "calls": calls, "stats": stats})


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=20)
    ap.add_argument("--freeze", type=float, default=5.0, help="seconds Redis stays SIGSTOPped")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds before measuring")
    ap.add_argument("--before", type=float, default=10.0, help="seconds measured before freezing")
    ap.add_argument("--after", type=float, default=5.0, help="seconds measured after resuming")
    ap.add_argument("--interval", type=float, default=0.005, help="sleep between calls, seconds")
    args = ap.parse_args()
    if not 1 <= args.processes <= 64 or not 0 < args.freeze <= 30:
        raise SystemExit("--processes must be 1..64 and --freeze within (0, 30] seconds")
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="askonce-stall-") as directory:
        port = free_port()
        redis = start_redis(directory, port)
        url = f"redis://127.0.0.1:{port}/0"
        procs: list[Any] = []
        try:
            ctx = mp.get_context("spawn")
            results = ctx.Queue()
            schedule, go = ctx.Array("d", 4), ctx.Event()
            procs = [ctx.Process(target=worker,
                                 args=(url, schedule, go, args.interval, results))
                     for _ in range(args.processes)]
            for p in procs:
                p.start()
            for _ in procs:
                results.get(timeout=120)
            measure_at = time.time() + args.warmup
            freeze_at = measure_at + args.before
            resume_at = freeze_at + args.freeze
            end = resume_at + args.after
            schedule[:] = [measure_at, freeze_at, resume_at, end]
            go.set()
            time.sleep(max(0.0, freeze_at - time.time()))
            redis.send_signal(signal.SIGSTOP)
            time.sleep(max(0.0, resume_at - time.time()))
            redis.send_signal(signal.SIGCONT)
            load_mid = os.getloadavg()
            got = [results.get(timeout=end - time.time() + 60) for _ in procs]
            for p in procs:
                p.join(timeout=30)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            stop_redis(redis)
    report(args, got, load_start, load_mid)


def report(args: argparse.Namespace, got: list[dict[str, Any]],
           load_start: tuple[float, float, float],
           load_mid: tuple[float, float, float]) -> None:
    seconds = {"before": args.before, "during": args.freeze, "after": args.after}
    print(f"{args.processes} processes, freeze {args.freeze:g} s, a call every "
          f"{args.interval * 1000:g} ms per process, {os.cpu_count()} CPUs; load average "
          f"{load_start[0]:.2f} at start, {load_mid[0]:.2f} at resume (1 min)\n")
    print("| phase | calls/s | call p99 ms | call max ms | calls > 50 ms "
          "| dead target arrivals/s |")
    print("|---|---:|---:|---:|---:|---:|")
    rate = {}
    for phase in PHASES:
        lat = [x for g in got for x in g["latencies"][phase]]
        arrivals = sum(g["arrivals"][phase] for g in got)
        rate[phase] = arrivals / seconds[phase]
        print(f"| {phase} | {len(lat) / seconds[phase]:.0f} | {pct(lat, 0.99) * 1000:.1f} | "
              f"{max(lat, default=float('nan')) * 1000:.1f} | {sum(x > BOUND for x in lat)} | "
              f"{rate[phase]:.1f} |")
    firsts = sorted(g["first_after"] for g in got if g["first_after"] is not None)
    worst = max(x for g in got for p in PHASES for x in g["latencies"][p])
    print(f"\nfirst call after SIGCONT, per process: min {firsts[0] * 1000:.1f} ms, median "
          f"{pct(firsts, 0.5) * 1000:.1f} ms, max {firsts[-1] * 1000:.1f} ms")
    slow = sorted((int(at // 1), dt) for g in got for at, dt in g["slow"])
    print("\ncalls over 50 ms by the second they started in (0 = the first second of the freeze):")
    for second in sorted({s for s, _ in slow}):
        dts = [dt for s, dt in slow if s == second]
        print(f"  second {second:+d}: {len(dts)} calls, median {pct(dts, 0.5) * 1000:.0f} ms, "
              f"max {max(dts) * 1000:.0f} ms")
    settles = sorted(g["settle"] for g in got)
    print(f"worst call in the first {RECONNECT:g} s after SIGCONT (when the store tries Redis "
          f"again), per process: median {pct(settles, 0.5) * 1000:.1f} ms, "
          f"max {settles[-1] * 1000:.1f} ms")
    counts = {p: sum(g["arrivals"][p] for g in got) for p in PHASES}
    print("dead target arrivals, counted: " + ", ".join(f"{p} {n}" for p, n in counts.items()))
    fallback = rate["during"] / rate["before"] if rate["before"] else float("inf")
    print(f"fallback arrivals / shared arrivals: {fallback:.1f}x (the issue's goal: at most 2x)")
    print(f"worst call / documented bound ({BOUND * 1000:.0f} ms): {worst / BOUND:.1f}x")
    during = [dt for s, dt in slow if 0 <= s < args.freeze]
    healthy = max(g["latencies"]["before"] for g in got if g["latencies"]["before"])
    print(f"calls that waited for the frozen Redis (over 50 ms during the freeze): {len(during)}, "
          f"median {pct(during, 0.5) * 1000:.1f} ms, p90 {pct(during, 0.9) * 1000:.1f} ms "
          f"= {pct(during, 0.9) / BOUND:.2f}x the bound")
    print(f"worst call during the freeze / worst call with Redis healthy (same run): "
          f"{max(during, default=0.0) / max(max(healthy), 1e-9):.2f}x")
    stats: dict[str, int] = {}
    for g in got:
        for k, v in g["stats"].items():
            stats[k] = stats.get(k, 0) + v
    print("store counters, summed: " + ", ".join(f"{k}={v}" for k, v in sorted(stats.items())))


if __name__ == "__main__":
    main()
