"""Run every benchmark script in ``bench/`` and collect their markdown output.

Every ``bench/*.py`` but this one (and ``_private.py`` helpers) runs in its own interpreter, one after
another (side by side they would measure each other), with a time limit. The collected markdown goes
to stdout, and with ``--out FILE`` to a file as well; a script that fails or times out is reported in
place of its table, and the exit status says whether all of them succeeded.

    python bench/run_all.py
    python bench/run_all.py --out /tmp/bench.md --only retry wire
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 120.0


def scripts(only: list[str] | None) -> list[Path]:
    found = sorted(p for p in HERE.glob("*.py") if p.name != Path(__file__).name and not p.name.startswith("_"))
    if only:
        found = [p for p in found if any(word in p.stem for word in only)]
    return found


def run_one(path: Path, extra: list[str]) -> tuple[str, bool, float]:
    t0 = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, str(path), *extra], capture_output=True, text=True,
                              timeout=TIMEOUT_S, cwd=HERE.parent)
    except subprocess.TimeoutExpired:
        return f"**{path.name} did not finish within {TIMEOUT_S:.0f} s.**", False, time.monotonic() - t0
    elapsed = time.monotonic() - t0
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        return (f"{proc.stdout.strip()}\n\n**{path.name} failed (exit {proc.returncode}):**\n\n```\n{tail}\n```",
                False, elapsed)
    return proc.stdout.strip(), True, elapsed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--out", type=Path, help="also write the collected markdown here")
    ap.add_argument("--only", nargs="*", help="run only scripts whose name contains one of these words")
    ap.add_argument("--profile", action="store_true", help="pass --profile to bench_retry.py")
    args = ap.parse_args(argv)

    found = scripts(args.only)
    if not found:
        print("no benchmark scripts matched", file=sys.stderr)
        return 2
    parts = [
        "## Benchmark run",
        "",
        f"{datetime.datetime.now().isoformat(timespec='seconds')}, Python {platform.python_version()}, "
        f"{platform.machine()}, {os.cpu_count()} CPUs; scripts: {', '.join(p.name for p in found)}.",
    ]
    all_ok = True
    for path in found:
        print(f"running {path.name} ...", file=sys.stderr, flush=True)
        extra = ["--profile"] if args.profile and path.name == "bench_retry.py" else []
        text, ok, elapsed = run_one(path, extra)
        all_ok &= ok
        parts += ["", f"<!-- {path.name}: {elapsed:.1f} s -->", "", text]
    report = "\n".join(parts) + "\n"
    print(report)
    if args.out:
        args.out.write_text(report, encoding="utf-8")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
