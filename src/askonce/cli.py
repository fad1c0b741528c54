"""The ``askonce`` command: ``demo`` | ``simulate`` | ``report`` | ``audit``.

Every error a user can meet ends with one line on stderr and exit status 2 (usage) or 1 (the
work could not be done): ``askonce._cli.fail`` writes it, ``_cli.Parser`` routes argparse's
usage errors through it, and :func:`main` turns a missing optional module into the extra to
install and a closed stdout (``askonce report --json | head``) into a quiet exit.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from askonce import __version__
from askonce._cli import FAILED, USAGE, Parser, fail

COMMANDS = ("demo", "simulate", "report", "audit")
# An optional module -> the extra that installs it.
EXTRAS = {"rich": "demo", "matplotlib": "plots", "redis": "redis", "fastapi": "demo",
          "starlette": "demo", "uvicorn": "demo", "flask": "demo", "waitress": "demo",
          "httpx": "demo", "requests": "demo"}


def main(argv: Sequence[str] | None = None) -> int:
    parser = Parser(prog="askonce", description="Stop retry storms across layers.")
    parser.add_argument("--version", action="version", version=f"askonce {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    from askonce.demo.cli import add_parser as add_demo  # cheap: the stack loads when it runs

    add_demo(sub)

    # cheap: the simulator loads when it runs
    from askonce.sim.cli import add_parser as add_simulate

    add_simulate(sub)

    from askonce.ledger.cli import add_audit_parser, add_report_parser

    add_report_parser(sub)
    add_audit_parser(sub)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        fail("askonce", f"a command is required: {', '.join(COMMANDS)}", USAGE)
    try:
        code: int = args.func(args)
        sys.stdout.flush()  # here, so that a closed stdout is seen here
    except ModuleNotFoundError as exc:
        root = (exc.name or "").partition(".")[0]
        if root not in EXTRAS:
            raise
        fail(f"askonce {args.command}", f"needs {root}: pip install 'askonce[{EXTRAS[root]}]'",
             FAILED)
    except BrokenPipeError:
        # https://docs.python.org/3/library/signal.html#note-on-sigpipe: no traceback, and no
        # second one when the interpreter flushes stdout on its way out.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):  # a stdout with no file descriptor (a test's capture)
            pass
        return FAILED
    return code


if __name__ == "__main__":
    sys.exit(main())
