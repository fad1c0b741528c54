"""The ``askonce`` command: ``demo`` | ``simulate`` | ``report`` | ``audit``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="askonce", description="Stop retry storms across layers.")
    sub = parser.add_subparsers(dest="command", required=True)
    from askonce.demo.cli import add_parser as add_demo  # cheap: the stack loads when it runs

    add_demo(sub)

    # cheap: the simulator loads when it runs
    from askonce.sim.cli import add_parser as add_simulate

    add_simulate(sub)

    from askonce.ledger.cli import add_audit_parser, add_report_parser

    add_report_parser(sub)
    add_audit_parser(sub)
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
