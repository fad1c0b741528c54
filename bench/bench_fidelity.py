"""Fidelity on this machine: the real demo's figures against the simulator's prediction of them.

    python bench/bench_fidelity.py                      # outage, transient, slow: about 60 s
    python bench/bench_fidelity.py --error-rates 0.1,0.5,0.9   # and the sweep: about 2 minutes more
    python bench/bench_fidelity.py --record tests/sim/data/demo.json
    python bench/bench_fidelity.py --scenarios stuck --record tests/sim/data/demo_stuck.json

Runs ``askonce demo --json`` (the real stack on 127.0.0.1), feeds its document to
``askonce.sim.fidelity.predict_demo`` (the demo's own draws replayed) and prints both side by side,
each row's mean arrivals per question and success rate held to 5 % (``fidelity.within``), and the
target's work per question where it is predicted (the stuck scenario). Exit 1 if a row disagrees.
On a machine starved of CPU the real stack measures the CPU, not retries (the demo's notes say when
its load generator launched late), so a disagreement there is not the model's.

``--record PATH``: also write the demo's document, for ``tests/sim/test_fidelity.py``, which checks
the model against that recording (virtual time: the same on a loaded machine). Record on a quiet
machine, and only a run whose notes report no late launches.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from askonce.sim import fidelity

SCENARIOS = "outage,transient,slow"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", type=Path, help="write the demo's document here")
    parser.add_argument("--error-rates", metavar="LIST",
                        help="also the demo's sweep of the transient scenario (askonce demo "
                             "--error-rates)")
    parser.add_argument("--scenarios", default=SCENARIOS, help=f"default {SCENARIOS}")
    args = parser.parse_args()
    sweep = [] if args.error_rates is None else ["--error-rates", args.error_rates]
    with tempfile.TemporaryDirectory() as out:
        done = subprocess.run([sys.executable, "-m", "askonce", "demo", "--json", "--scenarios",
                               args.scenarios, *sweep, "--out", str(Path(out) / "report")],
                              capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        print(done.stderr[-2000:], file=sys.stderr)
        return 1
    doc = json.loads(done.stdout)
    rows = fidelity.compare(doc, fidelity.predict_demo(doc))
    print(f"demo: {doc['date']}, {doc['machine']}; notes: {doc['notes'] or 'none'}\n")
    print(fidelity.table(rows))
    if args.record is not None:
        args.record.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"\nrecorded: {args.record}")
    return 0 if all(fidelity.agrees(r) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
