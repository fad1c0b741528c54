"""The ledger core alone: ``Ledger.record`` arrivals per CPU-second, on the fast path and past the exact-key limit.

    python bench/bench_ledger_core.py                                  # this tree, about 20 s
    python bench/bench_ledger_core.py --against /path/to/other/src     # and another tree, same run, ratios

Cases, each on a fresh ledger, 200,000 calls, one thread, the collector off:

* **new key, exact** - every arrival an attributable new key, below ``max_exact_keys`` (the fast path);
* **new key past the exact limit** - the default policy (10,000 exact keys per operation and window), its table
  filled first (untimed), then 200,000 distinct keys: the HyperLogLog and the heavy-key summary take each one
  (a flood of distinct keys always lands here);
* **repeat past the limit** - past the limit, 1,000 keys arriving over and over (the heavy-key summary's own path);
* **key again, retry in path** - one key over and over with a retried hop (the undeclared-retry bookkeeping);
* **mixed** - 4 operations, 3 principals, 3 paths, a key in ten arriving twice, 5 % unkeyed, below the limit.

CPU time of the benchmarking thread (``thread_time_ns``); each round runs every case three times in turn and keeps
the least (interference only ever adds), the table gives the median over rounds. With ``--against`` each
round runs this tree and the other in turn, each in its own interpreter (``PYTHONPATH`` set to the tree's
``src``), and the table gives both and their ratio per round, median over rounds.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

N = 200_000
REPEAT = 3  # per case and round, in turn; the round's figure is the least
HERE = Path(__file__).resolve().parent

CASES = ["new key, exact (fast path)", "new key past the exact limit", "repeat past the limit",
         "key again, retry in path", "mixed, below the limit"]


def _one_round() -> dict[str, float]:
    """ns of CPU per call for each case, measured in this interpreter (whatever ``askonce`` it imports)."""
    from askonce.core.ledger import Ledger, LedgerPolicy

    keys = [f"01JD5Q3W8M{i:026d}" for i in range(N)]
    path = (("edge", 1), ("gw", 1))
    retry = (("edge", 1), ("gw", 2))
    op = "GET /items/{id}"

    def timed(ledger: Ledger, run: Callable[[Ledger], None]) -> float:
        gc.collect()
        gc.disable()
        try:
            c0 = time.thread_time_ns()
            run(ledger)
            c1 = time.thread_time_ns()
        finally:
            gc.enable()
        return (c1 - c0) / N

    def fresh_keys(ledger: Ledger) -> None:
        r = ledger.record
        for k in keys:
            r(1.0, op, key=k, edge=True, path=path)

    def filled() -> Ledger:
        ledger = Ledger(LedgerPolicy())
        for i in range(ledger.policy.max_exact_keys):
            ledger.record(1.0, op, key=f"fill-{i:020d}", edge=True, path=path)
        return ledger

    def repeats(ledger: Ledger) -> None:
        r = ledger.record
        few = keys[:1000]
        for i in range(N):
            r(1.0, op, key=few[i % 1000], edge=True, path=path)

    def again(ledger: Ledger) -> None:
        r = ledger.record
        for _ in range(N):
            r(1.0, op, key="one-question-0000001", edge=True, path=retry)

    ops = [f"GET /r{i}/{{id}}" for i in range(4)]
    principals = ["", "tenant-1", "tenant-2"]
    paths = [path, retry, (("edge", 2), ("gw", 1))]
    mixed_args = [(ops[i % 4], None if i % 20 == 19 else keys[i - 1 if i % 10 == 1 else i],
                   principals[i % 3], paths[i % 7 % 3]) for i in range(N)]

    def mixed(ledger: Ledger) -> None:
        r = ledger.record
        for o, k, p, pa in mixed_args:
            r(1.0, o, key=k, edge=True, path=pa, principal=p)

    big = LedgerPolicy(max_exact_keys=10 * N)
    cases: list[tuple[Callable[[], Ledger], Callable[[Ledger], None]]] = [
        (lambda: Ledger(big), fresh_keys), (filled, fresh_keys), (filled, repeats), (lambda: Ledger(big), again),
        (lambda: Ledger(big), mixed)]
    best = [math.inf] * len(cases)
    for _ in range(REPEAT):
        for i, (make, run) in enumerate(cases):
            best[i] = min(best[i], timed(make(), run))
    return dict(zip(CASES, best, strict=True))


def _in_tree(src: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run([sys.executable, __file__, "--child"], capture_output=True, text=True, env=env,
                         check=True).stdout
    result: dict[str, float] = json.loads(out)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--against", type=Path, metavar="SRC", help="another tree's src/ to measure in the same run")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(_one_round()))
        return 0
    mine = HERE.parent / "src"
    trees = [mine] + ([args.against] if args.against else [])
    samples: dict[Path, list[dict[str, float]]] = {t: [] for t in trees}
    load = os.getloadavg()[0]
    for i in range(args.rounds):
        for t in trees if i % 2 == 0 else trees[::-1]:
            samples[t].append(_in_tree(t))
    print(f"### Ledger core: `Ledger.record` per CPU-second\n\n{datetime.date.today().isoformat()}, Python "
          f"{platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPUs, load average {load:.1f} at the "
          f"start, {os.getloadavg()[0]:.1f} at the end; median of {args.rounds} interleaved rounds of {N:,} calls, "
          f"CPU time of the benchmarking thread.\n")
    if args.against:
        print(f"| case | {args.against} ns/call | arrivals/s | this tree ns/call | arrivals/s | speed-up |")
        print("|---|---:|---:|---:|---:|---:|")
        for case in CASES:
            base = [s[case] for s in samples[args.against]]
            new = [s[case] for s in samples[mine]]
            b, n = statistics.median(base), statistics.median(new)
            ratio = statistics.median(x / y for x, y in zip(base, new, strict=True))
            print(f"| {case} | {b:,.0f} | {1e9 / b:,.0f} | {n:,.0f} | {1e9 / n:,.0f} | {ratio:.2f}x |")
    else:
        print("| case | ns/call | arrivals/s |")
        print("|---|---:|---:|")
        for case in CASES:
            n = statistics.median(s[case] for s in samples[mine])
            print(f"| {case} | {n:,.0f} | {1e9 / n:,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
