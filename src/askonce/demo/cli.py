"""``askonce demo``: registered by ``askonce.cli`` with :func:`add_parser`; nothing heavy is
imported here.

``askonce demo`` runs the real multi-process stack on 127.0.0.1 (:mod:`askonce.demo.main`);
``askonce demo --in-process`` runs the arithmetic of the same three layers in one process, no
sockets (:mod:`askonce.demo.inprocess`), and needs nothing but askonce.
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import Any

SCENARIOS = ("outage", "transient", "slow", "tail", "overload", "stuck")
# askonce.demo.params.DEMO_BUDGET, kept here so that `askonce --help` imports no demo module.
DEMO_BUDGET = 3
QUESTIONS, DEPTH = 1000, 3  # --in-process


def _scenarios(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"choose from {','.join(SCENARIOS)}, got {text!r}")
    return names


def _rates(text: str) -> tuple[float, ...]:
    rates = []
    for v in text.split(","):
        try:
            rate = float(v)
        except ValueError:
            rate = -1.0
        if not 0 <= rate <= 1:  # NaN fails too
            raise argparse.ArgumentTypeError(f"error rates within 0..1, comma-separated, "
                                             f"got {text!r}")
        rates.append(rate)
    return tuple(dict.fromkeys(rates))


def _grace(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 10:  # NaN fails too
        raise argparse.ArgumentTypeError(f"seconds within 0..10, got {text!r}")
    return value


def _questions(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"questions must be at least 1, got {text!r}")
    return value


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``demo`` to an ``argparse`` sub-parser group and set its handler (``func``)."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "demo",
        help="a real localhost stack, naive and with askonce, counted at the target",
        description="Start a gateway (FastAPI), an API (Flask), a service (FastAPI) and a target "
        "(Starlette) on 127.0.0.1, run each scenario with naive per-layer retries and with "
        "askonce, and compare what the target saw. Writes an HTML report with plots.",
    )
    p.add_argument("--quick", action="store_true",
                   help="smaller, shorter scenarios: about 70 s (a full run: about 4 minutes)")
    p.add_argument("--json", action="store_true",
                   help="print the results as JSON on stdout (progress on stderr)")
    p.add_argument("--out", type=Path, metavar="DIR",
                   help="report folder (default ./askonce-report-<timestamp>)")
    p.add_argument("--redis", metavar="URL",
                   help="keep buckets, breakers and the target's ledger in Redis")
    p.add_argument("--scenarios", type=_scenarios, metavar="LIST",
                   help=f"comma-separated subset of {','.join(SCENARIOS)} (default: all, or "
                        "none with --error-rates)")
    p.add_argument("--error-rates", type=_rates, default=(), metavar="LIST",
                   help="also sweep the transient scenario over these error rates, e.g. "
                        "0.1,0.5,0.9: no-retry, naive and askonce, 1,000 questions each")
    p.add_argument("--breaker", action="store_true",
                   help="askonce: a circuit breaker that opens on a run of failures on the layer "
                        "nearest the target, beside the adaptive admission every layer has")
    p.add_argument("--seed", type=int, default=1,
                   help="seed of the load, the keys and the target's failures")
    p.add_argument("--budget", type=int, default=DEMO_BUDGET, choices=range(11), metavar="N",
                   help="retries an askonce question may cost in all, across every layer "
                        f"(default {DEMO_BUDGET})")
    p.add_argument("--grace", type=_grace, default=0.0, metavar="S",
                   help="askonce clients' deadline_grace: retry timed-out tries whose callee "
                        "answers at its deadline (default 0, off, as in the library)")
    p.add_argument("--no-join", dest="join", action="store_false",
                   help="askonce layers do not join repeated questions (the target still counts "
                        "them): timed-out tries are then lost, as without JoinASGIMiddleware")
    p.add_argument("--in-process", action="store_true",
                   help="no sockets: the three layers' arithmetic in one process "
                        "(needs no extra package)")
    g = p.add_argument_group("--in-process only (refused without it)")
    g.add_argument("--questions", type=_questions, metavar="N",
                   help=f"questions per scenario and policy, at least 1 (default {QUESTIONS})")
    g.add_argument("--depth", type=int, choices=range(1, 6), metavar="N",
                   help=f"retrying layers, 1..5 (default {DEPTH})")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    if args.in_process:
        return _in_process(args)
    only = [flag for flag, value in (("--questions", args.questions), ("--depth", args.depth))
            if value is not None]
    if only:
        from askonce._cli import USAGE, fail

        verb = "apply" if len(only) > 1 else "applies"
        fail("askonce demo", f"{' and '.join(only)} only {verb} with --in-process", USAGE)
    from askonce.demo.main import Options, run_demo

    if args.scenarios is None:
        args.scenarios = () if args.error_rates else SCENARIOS
    return run_demo(Options(scenarios=args.scenarios, quick=args.quick, json=args.json,
                            out=args.out, redis=args.redis, seed=args.seed, budget=args.budget,
                            grace=args.grace, join=args.join, breaker=args.breaker,
                            error_rates=args.error_rates, command=_command(args)))


def _command(args: argparse.Namespace) -> str:
    """The command that reproduces the run (the report names it)."""
    words = ["askonce", "demo"]
    if args.quick:
        words.append("--quick")
    if tuple(args.scenarios) != (() if args.error_rates else SCENARIOS):
        words += ["--scenarios", ",".join(args.scenarios)]
    if args.error_rates:
        words += ["--error-rates", ",".join(f"{r:g}" for r in args.error_rates)]
    if args.breaker:
        words.append("--breaker")
    if args.seed != 1:
        words += ["--seed", str(args.seed)]
    if args.budget != DEMO_BUDGET:
        words += ["--budget", str(args.budget)]
    if args.grace:
        words += ["--grace", f"{args.grace:g}"]
    if not args.join:
        words.append("--no-join")
    if args.redis:
        words += ["--redis", args.redis]
    return shlex.join(words)


def _in_process(args: argparse.Namespace) -> int:
    from askonce.demo.inprocess import rows

    args.questions = QUESTIONS if args.questions is None else args.questions
    args.depth = DEPTH if args.depth is None else args.depth
    result = rows(questions=args.questions, depth=args.depth, budget=args.budget)
    if args.json:
        print(json.dumps({"mode": "in-process", "scenarios": [r.to_dict() for r in result]},
                         indent=2))
        return 0
    print(f"askonce demo (in-process): {args.depth} layers, each tries 3 times; "
          f"askonce budget {args.budget}; {args.questions} questions per row")
    print(f"{'scenario':<10} {'policy':<8} {'arrivals/question mean':>23} {'p99':>5} {'max':>5}"
          f" {'success':>8}")
    for r in result:
        print(f"{r.scenario:<10} {r.policy:<8} {r.mean:>23.3f} {r.p99:>5.0f} {r.max:>5d}"
              f" {r.success_rate:>8.1%}")
    print("\nArrivals are counted at the target per question key. Naive layers multiply "
          f"(3^{args.depth} = {3 ** args.depth}); askonce holds every question to 1 + budget.")
    return 0
