"""The target's ledger: record throughput in memory and through Redis, memory per key, audit throughput.

    python bench/bench_ledger.py                     # everything, in about 90 s; markdown on stdout
    python bench/bench_ledger.py --audit-mb 1024     # the audit on a 1 GiB log whatever it takes

* **record, in memory** - calls per second of ``record`` on one core: the core ``Ledger`` (the hot path:
  an attributable arrival of a new key), ``MemoryLedger`` (the core behind a lock), ``RedisLedger``
  (what the request path does without a cap: append to the buffer, with and without the local ledger).
  Interleaved rounds, medians, wall and CPU time of the benchmarking thread.
* **record, through Redis** - a real ``redis-server`` started here: how many arrivals per second one
  flush pushes (Python aggregation + Lua on the server, with the server's own CPU per arrival from
  ``INFO cpu``), the end-to-end rate with the flusher thread running beside one recording thread, and the
  capped request path (one Lua round trip per arrival) with its latency.
* **memory per key** - traced bytes per exactly tracked key in the core, and Redis ``used_memory`` per key.
* **audit** - MB/s and lines/s of ``askonce audit`` on generated JSON-lines and nginx logs. The size is
  chosen so that generating and auditing fit ``--audit-budget`` seconds (default 45), at most
  ``--audit-mb`` (default 1024); the table says which size was used.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # redis_server.py, test_ledger.measure_bytes_per_key

import redis  # noqa: E402

from askonce.core import wire  # noqa: E402
from askonce.core.ledger import Ledger, LedgerPolicy  # noqa: E402
from askonce.core.question import Hop  # noqa: E402
from askonce.ledger.audit import LogFormat, audit_file  # noqa: E402
from askonce.ledger.store import MemoryLedger, RedisLedger  # noqa: E402
from ledger_memory import measure_bytes_per_key  # noqa: E402
from redis_server import RedisServer  # noqa: E402

N = 100_000
KEYS = [f"01JD5Q3W8M{i:026d}" for i in range(N)]
PATH = (("edge", 1), ("gw", 1))
RETRY = (("edge", 1), ("gw", 2))
BIG = LedgerPolicy(max_exact_keys=10 * N)  # every key exact: the hot path, not the sketch


def _rate(make: Callable[[], Callable[[str], object]]) -> tuple[float, float]:
    """(wall, CPU) ns per call over the N keys, with a fresh recorder."""
    call = make()
    gc.collect()
    gc.disable()
    try:
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        for k in KEYS:
            call(k)
        t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
    finally:
        gc.enable()
    return (t1 - t0) / N, (c1 - c0) / N


def record_in_memory(rounds: int) -> list[str]:
    def core() -> Callable[[str], object]:
        r = Ledger(BIG).record
        return lambda k: r(1.0, "GET /items/{id}", key=k, edge=True, path=PATH)

    def core_repeat() -> Callable[[str], object]:
        r = Ledger(BIG).record
        return lambda k: r(1.0, "GET /items/{id}", key="one-question-0000001", edge=True, path=RETRY)

    def memory() -> Callable[[str], object]:
        r = MemoryLedger(BIG).record
        return lambda k: r(1.0, "GET /items/{id}", key=k, edge=True, path=PATH)

    def redis_buffer(local: bool) -> Callable[[], Callable[[str], object]]:
        def make() -> Callable[[str], object]:
            r = RedisLedger("redis://127.0.0.1:1/0", policy=BIG, start=False, max_buffer=2 * N, local=local).record
            return lambda k: r(1.0, "GET /items/{id}", key=k, edge=True, path=PATH)
        return make

    cases = {
        "core `Ledger.record`, new key (the hot path)": core,
        "core `Ledger.record`, one key again, retry in path": core_repeat,
        "`MemoryLedger.record` (core + lock)": memory,
        "`RedisLedger.record`, no cap, `local=False` (buffer append)": redis_buffer(False),
        "`RedisLedger.record`, no cap, with local ledger": redis_buffer(True),
    }
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, make in cases.items():
            samples[name].append(_rate(make))
    out = ["| call | wall ns/call | CPU ns/call | arrivals/s (wall) | arrivals/s (CPU) |", "|---|---:|---:|---:|---:|"]
    for name, s in samples.items():
        w, c = statistics.median(x for x, _ in s), statistics.median(y for _, y in s)
        out.append(f"| {name} | {w:,.0f} | {c:,.0f} | {1e9 / w:,.0f} | {1e9 / c:,.0f} |")
    return out


def _redis_cpu(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def record_via_redis(server: RedisServer) -> list[str]:
    client = redis.Redis.from_url(server.url)
    out = ["| what | arrivals | wall s | arrivals/s (wall) | client CPU µs/arrival | redis-server CPU µs/arrival |",
           "|---|---:|---:|---:|---:|---:|"]
    for label, keys_per, per_key in (("flush, every arrival a new key", N * 2, 1),
                                     ("flush, 3 arrivals per key (retries)", N * 2, 3)):
        shell = RedisLedger(server.url, prefix=f"b{per_key}", policy=BIG, start=False, max_buffer=10 * N, local=False)
        for i in range(keys_per):
            shell.record(1.0, "POST /orders", key=KEYS[(i // per_key) % N] + str(i // N), edge=True,
                         path=(("gw", 1 + i % per_key),))
        r0, c0, t0 = _redis_cpu(client), time.process_time(), time.perf_counter()
        assert shell.flush()
        wall, cpu, rcpu = time.perf_counter() - t0, time.process_time() - c0, _redis_cpu(client) - r0
        assert shell.report(1.0).totals().arrivals == keys_per
        out.append(f"| {label} | {keys_per:,} | {wall:.2f} | {keys_per / wall:,.0f} | {1e6 * cpu / keys_per:.1f} "
                   f"| {1e6 * rcpu / keys_per:.1f} |")
        shell.close()
    # End to end: one thread records as fast as it can while the flusher thread sends (GIL shared).
    shell = RedisLedger(server.url, prefix="e2e", policy=BIG, max_buffer=10 * N, local=False, flush_interval=0.05)
    r0, c0, t0 = _redis_cpu(client), time.process_time(), time.perf_counter()
    total = 3 * N
    for i in range(total):
        shell.record(1.0, "GET /items/{id}", key=KEYS[i % N] + str(i // N), edge=True, path=PATH)
    shell.close(timeout=60)
    wall, cpu, rcpu = time.perf_counter() - t0, time.process_time() - c0, _redis_cpu(client) - r0
    assert shell.report(1.0).totals().arrivals == total, "arrivals were lost"
    out.append(f"| record + flusher thread, until Redis has all | {total:,} | {wall:.2f} | {total / wall:,.0f} "
               f"| {1e6 * cpu / total:.1f} | {1e6 * rcpu / total:.1f} |")
    # The capped request path: one Lua round trip per arrival, sequential.
    shell = RedisLedger(server.url, prefix="cap", policy=LedgerPolicy(cap=3, max_exact_keys=10 * N), start=False)
    lat = []
    n = 5_000
    c0, t0 = time.process_time(), time.perf_counter()
    for i in range(n):
        s = time.perf_counter()
        shell.record(1.0, "POST /pay", key=KEYS[i // 4], edge=True, path=(("gw", 1 + i % 4),))
        lat.append(time.perf_counter() - s)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    lat.sort()
    shell.close()
    p50, p99 = 1e6 * lat[n // 2], 1e6 * lat[n * 99 // 100]
    out.append(f"| capped `record` (Lua INCR on the request path), one thread | {n:,} | {wall:.2f} | {n / wall:,.0f} "
               f"| {1e6 * cpu / n:.1f} | latency p50 {p50:.0f} µs, p99 {p99:.0f} µs |")
    client.close()
    return out


def memory_per_key(server: RedisServer) -> list[str]:
    client = redis.Redis.from_url(server.url)
    client.flushall()
    before = int(client.info("memory")["used_memory"])
    shell = RedisLedger(server.url, prefix="mem", policy=BIG, start=False, max_buffer=2 * N, local=False)
    for k in KEYS:
        shell.record(1.0, "GET /items/{id}", key=k, edge=True, path=PATH)
    shell.flush()
    redis_bytes = (int(client.info("memory")["used_memory"]) - before) / N
    shell.close()
    client.close()
    return ["| where | bytes per exactly tracked key |", "|---|---:|",
            f"| core ledger, its own structures (tracemalloc) | {measure_bytes_per_key(N, with_keys=False):.0f} |",
            f"| core ledger, with the 36-char key string it keeps alive | {measure_bytes_per_key(N):.0f} |",
            f"| Redis `used_memory`, per-key field + (key, path) field, 36-char key | {redis_bytes:.0f} |"]


def _log_lines(kind: str) -> Callable[[int], bytes]:
    """A line generator: mostly honest questions, some retried, some undeclared, unkeyed, re-minted."""
    paths = [(Hop("edge", 1), Hop("gw", 1)), (Hop("edge", 1), Hop("gw", 2)), (Hop("edge", 2), Hop("gw", 1))]
    templates = []
    for p in paths:
        h = wire.format_question("KEY_PLACEHOLDER_0000000000000000000", "edge", True, 2, 1.5, p)
        templates.append(h)
    remint = wire.format_question("KEY_PLACEHOLDER_0000000000000000000", "mid", False, 2, 1.5, ())

    def line(i: int) -> bytes:
        t = 1_700_000_000 + i / 1000
        roll = i % 20
        key = f"K{i // 2 if roll < 4 else i:035d}"
        h = None if roll == 19 else (remint if roll == 18 else templates[roll % 3]).replace(
            "KEY_PLACEHOLDER_0000000000000000000", key)
        op = "GET /items/{id}" if i % 3 else "POST /orders"
        if kind == "jsonl":  # formatted by hand: json.dumps of a dict per line would be most of the cost
            value = "null" if h is None else json.dumps(h)
            return (f'{{"time": {t!r}, "operation": "{op}", "status": 200, "bytes": 512, "principal": "tenant-1", '
                    f'"askonce_question": {value}}}\n').encode()
        stamp = time.strftime("%d/%b/%Y:%H:%M:%S +0000", time.gmtime(t))
        value = "-" if h is None else h.replace('"', "\\x22")
        path = f"/items/{i}" if i % 3 else "/orders"
        method = "GET" if i % 3 else "POST"
        return (f'10.1.2.3 - - [{stamp}] "{method} {path} HTTP/1.1" 200 512 "-" "python-httpx/0.27" '
                f'"{value}"\n').encode()

    return line


def _generate(path: Path, kind: str, megabytes: float) -> tuple[int, float]:
    line = _log_lines(kind)
    limit = int(megabytes * 1024 * 1024)
    size = lines = 0
    t0 = time.perf_counter()
    with open(path, "wb", buffering=1 << 20) as f:
        while size < limit:
            chunk = b"".join(line(i) for i in range(lines, lines + 10_000))
            f.write(chunk)
            size += len(chunk)
            lines += 10_000
    return lines, time.perf_counter() - t0


def audit_throughput(budget: float, max_mb: float, forced: bool) -> list[str]:
    out = ["| format | size | lines | generate s | audit wall s | MB/s (wall) | MB/s (CPU) | lines/s (CPU) "
           "| amplification | coverage | approximate |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    with tempfile.TemporaryDirectory(prefix="askonce-bench-") as tmp:
        for kind, share in (("jsonl", 2 / 3), ("nginx", 1 / 3)):
            fmt = LogFormat(kind=kind)
            probe = Path(tmp) / f"probe.{kind}"
            _, gen_s = _generate(probe, kind, 8)
            t0 = time.perf_counter()
            audit_file(str(probe), fmt)
            per_mb = (gen_s + time.perf_counter() - t0) / 8  # seconds per MiB, generate + audit
            mb = max_mb if forced else min(max_mb, max(8.0, share * budget / per_mb))
            path = Path(tmp) / f"log.{kind}"
            lines, gen_s = _generate(path, kind, mb)
            probe.unlink()
            size = path.stat().st_size / 1024 / 1024
            c0, t0 = time.process_time(), time.perf_counter()
            result = audit_file(str(path), fmt)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            assert result.lines == lines and not result.bad
            tot = result.report.totals()
            out.append(f"| {kind} | {size:,.0f} MiB | {lines:,} | {gen_s:.1f} | {wall:.1f} | {size / wall:.1f} "
                       f"| {size / cpu:.1f} | {lines / cpu:,.0f} | {tot.amplification:.3f} | {tot.coverage:.3f} "
                       f"| {tot.approximate} |")
            path.unlink()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--audit-budget", type=float, default=45.0, help="seconds for generating + auditing logs")
    ap.add_argument("--audit-mb", type=float, default=None, help="audit logs of this many MiB, whatever it takes")
    args = ap.parse_args(argv)
    load = os.getloadavg()[0]
    lines = ["### The target's ledger: record throughput, memory per key, audit throughput", "",
             f"{datetime.date.today().isoformat()}, Python {platform.python_version()}, {platform.machine()}, "
             f"{os.cpu_count()} CPUs, load average {load:.1f} at the start. `python bench/bench_ledger.py`.", "",
             "#### record, in memory (one thread, medians of "
             f"{args.rounds} interleaved rounds of {N:,} calls)", ""]
    lines += record_in_memory(args.rounds)
    server = RedisServer(tempfile.mkdtemp(prefix="askonce-bench-redis-"))
    server.start()
    try:
        lines += ["", "#### record, through a real redis-server on loopback", ""]
        lines += record_via_redis(server)
        lines += ["", "#### memory per tracked key", ""]
        lines += memory_per_key(server)
    finally:
        server.stop()
    lines += ["", "#### askonce audit (window 3600 s, 50,000 exact keys per operation and window)", ""]
    lines += audit_throughput(args.audit_budget, args.audit_mb or 1024.0, args.audit_mb is not None)
    lines += ["", f"Load average at the end: {os.getloadavg()[0]:.1f}."]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
