"""``askonce simulate``: the standard experiments on the simulator, as tables, JSON or plots.

Registered by ``askonce.cli`` with :func:`add_parser`; everything heavy is imported only when the
command runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import sys
from typing import Any

SCENARIO_NAMES = ("depth", "transient", "clients", "overload", "slow", "jitter", "tail", "stuck")
QUICK = 0.1  # --quick: this share of each scenario's duration


def _floats(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one number")
    return values


def _ints(text: str) -> list[int]:
    values = _floats(text)
    if any(v != int(v) or v < 1 for v in values):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated whole numbers >= 1, got {text!r}")
    return [int(v) for v in values]


def _bounded(name: str, high: float) -> Any:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not 0 < value <= high:  # NaN fails too
            raise argparse.ArgumentTypeError(f"{name} must be within (0, {high:g}], got {text!r}")
        return value

    return parse



def _names(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``simulate`` to an ``argparse`` sub-parser group and set its handler (``func``)."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "simulate",
        help="the standard experiments on a discrete-event simulator driving the real core",
        description="Run the standard experiments (docs/results.md) on a virtual clock with seeded "
        "randomness. Every hop makes its decisions with the library's own RetryState, Account "
        "escrow, token buckets, breakers and ledger.",
    )
    p.add_argument("--scenario", choices=(*SCENARIO_NAMES, "all"), default="all",
                   help="which experiment to run (default: all of them)")
    p.add_argument("--policies", type=_names, default=None,
                   help="comma-separated subset of no-retry,naive,bucket,breaker,askonce "
                        "(jitter: no-jitter,full-jitter,askonce)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true",
                   help="print one JSON document instead of tables")
    p.add_argument("--plots", metavar="DIR",
                   help="write one PNG per scenario into DIR (needs matplotlib)")
    p.add_argument("--quick", action="store_true",
                   help=f"run {QUICK * 100:.0f}%% of each duration (a smoke test)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    g = p.add_argument_group("the world")
    g.add_argument("--duration", type=_bounded("duration", 86_400.0),
                   help="seconds of issued questions (depth, transient, clients)")
    g.add_argument("--rate", type=_bounded("rate", 1e7),
                   help="questions per second, all clients together")
    g.add_argument("--depths", type=_ints, help="depth, transient: retrying layers, e.g. 1,2,3,4,5 "
                   "(clients, overload: the first one)")
    g.add_argument("--error-rates", type=_floats, help="transient: e.g. 0.01,0.1,0.5")
    g.add_argument("--clients", type=_ints,
                   help="clients: counts, e.g. 10,100,1000; jitter: the first one")
    g.add_argument("--triggers", type=_floats,
                   help="overload: seconds of the capacity cut, e.g. 2,5,10")
    g.add_argument("--slow-times", type=_floats,
                   help="stuck: seconds of the target's work per arrival, e.g. 3,5")
    g.add_argument("--attempt-timeout", action="store_true",
                   help="stuck: the layers' timeout is ClientPolicy.attempt_timeout, which a "
                        "layer lifts toward a callee that joins (default: the transport's own)")
    k = p.add_argument_group("the policies")
    k.add_argument("--attempts", type=int,
                   help="attempts per layer (default 3; overload 4; jitter 100)")
    k.add_argument("--budget", type=int,
                   help="askonce: retries per question (default 2; jitter 99)")
    k.add_argument("--bucket-ratio", type=float,
                   help="askonce: a retry bucket earning this many tokens per request, "
                        "plus 10/s (library default: no bucket)")
    k.add_argument("--bucket-floor", type=float,
                   help="bucket baseline: retries/s always allowed (default 1)")
    k.add_argument("--breaker-rate", type=float,
                   help="breakers: failure rate that opens them (default 0.5)")
    k.add_argument("--breaker-min-calls", type=int,
                   help="breakers: calls in the window before a verdict "
                        "(default 20; the demo's breaker: 3)")
    k.add_argument("--breaker-window", type=int,
                   help="breakers: calls in the count window (default 100)")
    k.add_argument("--breaker-open-for", type=float,
                   help="breakers: seconds open before probes are let through "
                        "(default 2; the demo's breaker: 1)")
    k.add_argument("--breaker-kind", choices=("count", "time"),
                   help="breakers: a window of the last calls, or of the last seconds")
    k.add_argument("--askonce-breaker", action="store_true",
                   help="askonce: the breaker on the layer nearest the target too "
                        "(the breaker design, with --no-admission)")
    k.add_argument("--no-admission", action="store_true",
                   help="askonce: no adaptive admission on the layer nearest the target")
    k.add_argument("--admission-min-success", type=float,
                   help="askonce: success rate below which attempts are shed (default 0.05)")
    k.add_argument("--admission-max-reject", type=float,
                   help="askonce: the most attempts ever shed (default 0.99)")
    k.add_argument("--admission-window", type=int,
                   help="askonce: seconds of admission history (default 10)")
    k.add_argument("--admission-min-requests", type=int,
                   help="askonce: requests in the window before any shedding (default 20)")
    k.add_argument("--admission-sre", action="store_true",
                   help="askonce: the SRE book's formula (requests, not calls, in it)")
    k.add_argument("--grace", type=float,
                   help="askonce: each layer's deadline_grace, seconds "
                        "(default 0: timed-out tries are not retried)")
    k.add_argument("--no-concurrency", action="store_true",
                   help="askonce: no adaptive concurrency limit at the target")
    k.add_argument("--per-client", action="store_true",
                   help="askonce: a bucket, breaker and admission controller per client instead "
                        "of one for the fleet")
    p.set_defaults(func=run)
    return p


def _knobs(base: Any, args: argparse.Namespace) -> Any:
    from askonce.core.admission import AdmissionPolicy
    from askonce.core.bucket import BucketPolicy

    changes: dict[str, Any] = {}
    if args.attempts is not None:
        changes["attempts"] = args.attempts
    if args.budget is not None:
        changes["budget"] = args.budget
    if args.bucket_ratio is not None:
        changes["bucket"] = BucketPolicy(ratio=args.bucket_ratio)
    if args.bucket_floor is not None:
        changes["baseline_bucket"] = dataclasses.replace(base.baseline_bucket,
                                                         floor=args.bucket_floor)
    breaker = {name: value for name, value in (("failure_rate", args.breaker_rate),
                                                ("minimum_calls", args.breaker_min_calls),
                                                ("window_size", args.breaker_window),
                                                ("open_for", args.breaker_open_for),
                                                ("window", args.breaker_kind))
               if value is not None}
    if breaker:
        # Validated: a clear error if absurd.
        changes["breaker"] = dataclasses.replace(base.breaker, **breaker)
    if args.askonce_breaker:
        changes["askonce_breaker"] = True
    admission = {name: value for name, value in (
        ("min_success", args.admission_min_success), ("max_reject", args.admission_max_reject),
        ("window", args.admission_window), ("min_requests", args.admission_min_requests),
        ("count_rejected", True if args.admission_sre else None)) if value is not None}
    if args.no_admission:
        changes["admission"] = None
    elif admission:
        changes["admission"] = dataclasses.replace(base.admission or AdmissionPolicy(),
                                                   **admission)
    if args.grace is not None:
        changes["grace"] = args.grace
    if args.per_client:
        changes["shared"] = False
    if args.no_concurrency:
        changes["concurrency"] = None
    return dataclasses.replace(base, **changes)


def _scenario_kwargs(name: str, args: argparse.Namespace) -> dict[str, Any]:
    from askonce.sim import scenarios as s
    from askonce.sim.world import MAX_QUESTIONS

    fn = s.SCENARIOS[name]
    defaults = {k: v.default for k, v in inspect.signature(fn).parameters.items()}
    kw: dict[str, Any] = {"seed": args.seed, "knobs": _knobs(defaults["knobs"], args)}
    if args.policies:
        kw["policies"] = args.policies
    for policy in kw.get("policies", defaults.get("policies", ())):
        s.preset(policy, kw["knobs"])  # a bad name or knob: ValueError now, not after some runs
    if "duration" in defaults:
        duration = args.duration if args.duration is not None else defaults["duration"]
        kw["duration"] = duration * (QUICK if args.quick else 1)
    if args.rate is not None and "rate" in defaults:
        kw["rate"] = args.rate
    if "duration" in kw and "rate" in defaults:
        questions = kw["duration"] * kw.get("rate", defaults["rate"])
        if questions > MAX_QUESTIONS:
            raise ValueError(f"{name}: rate x duration is {questions:.3g} questions per run; "
                             f"at most {MAX_QUESTIONS:.0e}")
    if args.depths and "depths" in defaults:
        kw["depths"] = args.depths
    elif args.depths and "depth" in defaults:  # clients, overload: one stack depth
        kw["depth"] = args.depths[0]
    if args.error_rates and "error_rates" in defaults:
        kw["error_rates"] = args.error_rates
    if args.clients:
        if "counts" in defaults:
            kw["counts"] = args.clients
        elif name == "jitter":
            kw["clients"] = args.clients[0]
    if args.triggers and "triggers" in defaults:
        kw["triggers"] = args.triggers
    if args.slow_times and "slow_times" in defaults:
        kw["slow_times"] = args.slow_times
    if args.attempt_timeout and "transport" in defaults:
        kw["transport"] = False
    return kw


def run(args: argparse.Namespace) -> int:
    from askonce import __version__
    from askonce.sim import report
    from askonce.sim import scenarios as s

    names = SCENARIO_NAMES if args.scenario == "all" else (args.scenario,)

    def progress(row: s.Row) -> None:
        if not args.quiet:
            mean = "-" if row.mean is None else f"{row.mean:.3f}"
            print(f"  {row.scenario} {dict(row.params)} {row.policy}: A {mean}, "
                  f"success {row.success_rate:.2%} ({row.wall_s:.1f} s)", file=sys.stderr)

    rows: list[s.Row] = []
    try:
        # Every usage error before any run.
        kwargs = {name: _scenario_kwargs(name, args) for name in names}
        if args.plots:
            import matplotlib  # noqa: F401  # missing: askonce.cli names the extra

            from askonce._cli import writable_dir

            writable_dir("askonce simulate", "--plots", args.plots)
        for name in names:
            rows += s.SCENARIOS[name](**kwargs[name], progress=progress)
    except ValueError as exc:  # a bad policy name or parameter: say which, not a traceback
        print(f"askonce simulate: {exc}", file=sys.stderr)
        return 2
    if args.json:
        meta = {"version": __version__, "seed": args.seed, "quick": args.quick,
                "argv": sys.argv[1:]}
        print(json.dumps(report.document(rows, meta), indent=2))
    else:
        print(report.table(rows), end="")
    if args.plots:
        for path in report.plots(rows, args.plots):
            print(f"wrote {path}", file=sys.stderr)
    return 0
