"""Breaker overhead against pybreaker and circuitbreaker, and Redis-backed bucket throughput.

    python bench/bench_breaker.py            # all three parts, < 60 s; prints markdown tables
    python bench/bench_breaker.py overhead   # only the in-process breakers
    python bench/bench_breaker.py paths      # only the memory handle's other paths (failures, refusals)
    python bench/bench_breaker.py redis      # only Redis (starts its own redis-server on a free port)

Overhead: a successful call of a function that returns at once, through each breaker, all closed and
configured alike (open after 5 failures). Contenders run interleaved in rounds so that a noisy
neighbour slows all of them alike; each contender's figures are its best and its median round (ns per
call, wall clock) and its best round in CPU time (``time.process_time``, which a neighbour's work does
not inflate), and the ratios compare askonce's best round (wall, then CPU) with the faster of pybreaker and
circuitbreaker in the same run. askonce's figures include the two clock reads the shell makes (allow
before the call, record with the duration after it).

Paths: what the memory handle costs off the success path, in CPU time per call (best of 9 rounds, the
loop's own cost taken off): a failure recorded under the lock, a success while the window still has
fewer than ``minimum_calls`` calls (also under the lock), a call refused by an open breaker (``allow``
then ``retry_at``, as the guard does), and a stream of calls of which 1 in 100 fails.

Redis: one connection to a local redis-server; "decisions/s" are retry-token withdrawals answered.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
import timeit
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

ROUNDS = 15
CALLS = 20_000


def _fn() -> int:
    return 1


def contenders() -> dict[str, Callable[[], object]]:
    import circuitbreaker
    import pybreaker

    from askonce.breakers import BreakerRegistry
    from askonce.core.breaker import BreakerPolicy
    from askonce.stores.memory import BreakerHandle, MemoryStore

    mono = time.monotonic
    store = MemoryStore(mono)

    def through(handle: BreakerHandle) -> Callable[[], object]:
        allow, record = handle.allow, handle.record

        def call() -> object:
            start = mono()
            allow(start)
            result = _fn()
            end = mono()
            record(end, success=True, duration=end - start)
            return result
        return call

    breaker = BreakerRegistry().get("bench")
    call = BreakerRegistry().get("bench").call  # a breaker of its own, as the guard's

    def askonce_guard() -> object:
        with breaker.guard():
            return _fn()

    pb = pybreaker.CircuitBreaker(fail_max=5, reset_timeout=30)
    cb_fn = circuitbreaker.CircuitBreaker(failure_threshold=5, recovery_timeout=30)(_fn)
    return {
        "no breaker": _fn,
        "askonce memory handle (allow + record)": through(store.breaker("bench", BreakerPolicy())),
        "askonce memory handle, 10 s time window": through(
            store.breaker("bench-time", BreakerPolicy(window="time", window_size=10))),
        "askonce guard (`with breaker.guard()`)": askonce_guard,
        "askonce `breaker.call(fn)`": lambda: call(_fn),
        f"pybreaker {version('pybreaker')}": lambda: pb.call(_fn),
        f"circuitbreaker {version('circuitbreaker')}": cb_fn,
    }


def bench_overhead() -> str:
    runs = contenders()
    wall: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    gc.disable()
    try:
        for _ in range(ROUNDS):
            for name, fn in runs.items():
                began = time.process_time()
                wall[name].append(timeit.timeit(fn, number=CALLS) / CALLS * 1e9)
                cpu[name].append((time.process_time() - began) / CALLS * 1e9)
    finally:
        gc.enable()
    best = {name: min(v) for name, v in wall.items()}
    best_cpu = {name: min(v) for name, v in cpu.items()}
    others = [k for k in runs if k.startswith(("pybreaker", "circuitbreaker"))]
    theirs, theirs_cpu = min(best[k] for k in others), min(best_cpu[k] for k in others)
    bare = best["no breaker"]
    lines = ["| breaker (successful call) | ns/call | overhead ns | median round ns | CPU ns | vs fastest other "
             "| (CPU) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, ns in best.items():
        ratios = ("", "") if name == "no breaker" else (f"{ns / theirs:.2f}x", f"{best_cpu[name] / theirs_cpu:.2f}x")
        lines.append(f"| {name} | {ns:.0f} | {max(0.0, ns - bare):.0f} | {statistics.median(wall[name]):.0f} "
                     f"| {best_cpu[name]:.0f} | {ratios[0]} | {ratios[1]} |")
    return "\n".join(lines)


def bench_paths(rounds: int = 9, calls: int = 20_000) -> str:
    from askonce.core.breaker import BreakerPolicy
    from askonce.stores.memory import MemoryStore

    store = MemoryStore(time.monotonic)
    never_judged = BreakerPolicy(window_size=1_000_000, minimum_calls=1_000_000, failure_rate=1.0)
    failing = store.breaker("fail", never_judged)
    young = store.breaker("young", never_judged)
    opened = store.breaker("open", BreakerPolicy())
    opened.force_open(time.monotonic())
    mixed = store.breaker("mixed", BreakerPolicy(failure_rate=1.0))
    beat = iter(range(1 << 62))

    def refused() -> None:
        if not opened.allow(time.monotonic()):
            opened.retry_at()

    def one_in_100() -> None:
        mixed.record(1.0, success=next(beat) % 100 != 0)

    paths: dict[str, Callable[[], object]] = {
        "loop": lambda: None,
        "failure recorded (closed, under the lock)": lambda: failing.record(1.0, success=False),
        "success before minimum_calls (under the lock)": lambda: young.record(1.0, success=True),
        "refused by an open breaker (allow + retry_at, one clock read)": refused,
        "1 call in 100 failing (per call)": one_in_100,
    }
    best = dict.fromkeys(paths, float("inf"))
    gc.disable()
    try:
        for _ in range(rounds):
            for name, fn in paths.items():
                began = time.process_time()
                for _ in range(calls):
                    fn()
                best[name] = min(best[name], (time.process_time() - began) / calls * 1e9)
    finally:
        gc.enable()
    loop = best.pop("loop")
    lines = ["| memory handle path | CPU ns/call |", "|---|---:|"]
    lines += [f"| {name} | {ns - loop:.0f} |" for name, ns in best.items()]
    return "\n".join(lines)


def _rate(seconds: float, step: Callable[[], int]) -> float:
    """Operations per second of ``step`` (which returns how many it did) over ``seconds``."""
    done, began = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - began) < seconds:
        done += step()
    return done / elapsed


def bench_redis(seconds: float = 1.5) -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from askonce.core.breaker import BreakerPolicy
    from askonce.core.bucket import BucketPolicy
    from askonce.stores._redis_lua import bucket_args
    from askonce.stores.redis import RedisStore
    from redis_server import redis_server

    rows: list[tuple[str, float]] = []
    policy = BucketPolicy(ratio=0.1, floor=1e6, max_tokens=100.0)  # a floor so high every withdrawal succeeds
    with redis_server() as server:
        store = RedisStore(server.url, op_timeout=1.0)
        bucket = store.bucket("bench", policy)
        rows.append(("withdraw via handle (1 script call each)",
                     _rate(seconds, lambda: int(bucket.withdraw(0.0)) or 1)))

        key = [bucket._keys[0]]
        args = bucket_args(policy, 0, True, store.ttl_ms)
        script = store.bucket_script

        def pipelined(n: int) -> Callable[[], int]:
            def step() -> int:
                pipe = store.client.pipeline(transaction=False)
                for _ in range(n):
                    script(keys=key, args=args, client=pipe)
                pipe.execute()
                return n
            return step

        for n in (10, 100):
            rows.append((f"withdraw, pipelined {n} per round trip", _rate(seconds, pipelined(n))))

        def cycle(batch: int) -> Callable[[], int]:
            handle = RedisStore(server.url, op_timeout=1.0, deposit_batch=batch).bucket(f"bench-{batch}", policy)

            def step() -> int:
                # One request (a deposit) and, one time in ten, a retry decision: a 10 % failure rate.
                for _ in range(9):
                    handle.deposit()
                handle.deposit()
                handle.withdraw(0.0)
                return 10
            return step

        rows.append(("requests (deposit, 10 % withdraw), deposit_batch=1", _rate(seconds, cycle(1))))
        rows.append(("requests (deposit, 10 % withdraw), deposit_batch=32", _rate(seconds, cycle(32))))

        breaker = store.breaker("bench", BreakerPolicy())

        def call() -> int:
            now = time.monotonic()
            breaker.allow(now)
            breaker.record(time.monotonic(), success=True)
            return 1

        rows.append(("breaker allow + record via Redis (calls/s)", _rate(seconds, call)))
        store.close()
    lines = ["| Redis, one connection | per second |", "|---|---:|"]
    lines += [f"| {name} | {rate:,.0f} |" for name, rate in rows]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    parts = argv or ["overhead", "paths", "redis"]
    began = time.perf_counter()
    print(f"python {sys.version.split()[0]}, {time.strftime('%Y-%m-%d')}\n")
    if "overhead" in parts:
        print(bench_overhead() + "\n")
    if "paths" in parts:
        print(bench_paths() + "\n")
    if "redis" in parts:
        print(bench_redis() + "\n")
    print(f"({time.perf_counter() - began:.1f} s in all)")


if __name__ == "__main__":
    main(sys.argv[1:])
