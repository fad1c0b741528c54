"""The ``askonce`` command: ``demo`` | ``simulate`` | ``report`` | ``audit``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence


def _demo(args: argparse.Namespace) -> int:
    from askonce.demo.inprocess import rows

    result = rows(questions=args.questions, depth=args.depth, budget=args.budget)
    if args.json:
        print(json.dumps({"mode": "in-process", "scenarios": [r.to_dict() for r in result]}, indent=2))
        return 0
    print(f"askonce demo (in-process): {args.depth} layers, each tries 3 times; "
          f"askonce budget {args.budget}; {args.questions} questions per row")
    print(f"{'scenario':<10} {'policy':<8} {'arrivals/question mean':>23} {'p99':>5} {'max':>5} {'success':>8}")
    for r in result:
        print(f"{r.scenario:<10} {r.policy:<8} {r.mean:>23.3f} {r.p99:>5.0f} {r.max:>5d} {r.success_rate:>8.1%}")
    print("\nArrivals are counted at the target per question key. Naive layers multiply "
          f"(3^{args.depth} = {3 ** args.depth}); askonce holds every question to 1 + budget.")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="askonce", description="Stop retry storms across layers.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="naive nested retries against askonce, counted at the target")
    demo.add_argument("--questions", type=int, default=1000)
    demo.add_argument("--depth", type=int, default=3, choices=range(1, 6))
    demo.add_argument("--budget", type=int, default=2)
    demo.add_argument("--json", action="store_true", help="print JSON for machines")
    demo.set_defaults(func=_demo)

    from askonce.sim.cli import add_parser as add_simulate  # cheap: the simulator loads when it runs

    add_simulate(sub)

    from askonce.ledger_cli import add_audit_parser, add_report_parser

    add_report_parser(sub)
    add_audit_parser(sub)
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
