"""``askonce audit`` throughput: MB/s of JSON lines and nginx logs, per engine, against another tree in the same run.

    python bench/bench_audit.py                                   # this tree, both engines, 64 MiB logs
    python bench/bench_audit.py --against /path/to/other/src --mb 128

The logs are ``bench_ledger.py``'s (mostly honest questions, some retried, undeclared, unkeyed, re-minted; one key in
ten twice, the rest distinct: past 50,000 keys per operation and hour the sketches take them). Each run audits each
log once per tree and engine in its own interpreter, in turn, for ``--rounds`` rounds; the table gives medians of
wall-clock and CPU MB/s (CPU: the process's, all its threads) and checks that every run reported the same figures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _child(path: str, kind: str, engine: str) -> None:
    import inspect

    from askonce.ledger.audit import LogFormat, audit_file

    # a tree from before the engines has only the line-by-line reader
    kwargs = {"engine": engine} if "engine" in inspect.signature(audit_file).parameters else {}
    c0, t0 = time.process_time(), time.perf_counter()
    result = audit_file(path, LogFormat(kind=kind), **kwargs)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(json.dumps({"wall": wall, "cpu": cpu, "figures": json.dumps(result.to_dict(), sort_keys=True)}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--mb", type=float, default=64.0, help="MiB per log")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--against", type=Path, metavar="SRC", help="another tree's src/ (the line-by-line reader only)")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(*args.child)
        return 0
    sys.path.insert(0, str(HERE))
    from bench_ledger import _generate

    mine = HERE.parent / "src"
    runs = [("this tree", mine, "polars"), ("this tree", mine, "python")]
    if args.against:
        runs.append((str(args.against), args.against, "python"))
    load = os.getloadavg()[0]
    out = ["### askonce audit throughput", "",
           f"{datetime.date.today().isoformat()}, Python {platform.python_version()}, {platform.machine()}, "
           f"{os.cpu_count()} CPUs, load average {load:.1f} at the start. `python bench/bench_audit.py "
           f"--mb {args.mb:g}{' --against ' + str(args.against) if args.against else ''}`. MB = 10^6 bytes.", "",
           "| log | tree | engine | MB | MB/s (wall) | MB/s (CPU) | same figures |", "|---|---|---|---:|---:|---:|---|"]
    with tempfile.TemporaryDirectory(prefix="askonce-bench-audit-") as tmp:
        for kind in ("jsonl", "nginx"):
            path = Path(tmp) / f"log.{kind}"
            _generate(path, kind, args.mb)
            size = path.stat().st_size / 1e6
            samples: dict[int, list[dict[str, float]]] = {i: [] for i in range(len(runs))}
            figures: set[str] = set()
            for r in range(args.rounds):
                order = range(len(runs)) if r % 2 == 0 else reversed(range(len(runs)))
                for i in order:
                    _, src, engine = runs[i]
                    env = {**os.environ, "PYTHONPATH": str(src)}
                    done = subprocess.run([sys.executable, __file__, "--child", str(path), kind, engine], env=env,
                                          capture_output=True, text=True, check=True)
                    got = json.loads(done.stdout)
                    figures.add(got.pop("figures"))
                    samples[i].append(got)
            for i, (tree, _, engine) in enumerate(runs):
                wall = statistics.median(size / s["wall"] for s in samples[i])
                cpu = statistics.median(size / s["cpu"] for s in samples[i])
                out.append(f"| {kind} | {tree} | {engine} | {size:,.0f} | {wall:.1f} | {cpu:.1f} | "
                           f"{'yes' if len(figures) == 1 else 'NO'} |")
    out += ["", f"Load average at the end: {os.getloadavg()[0]:.1f}."]
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
