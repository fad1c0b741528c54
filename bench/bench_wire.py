"""Wire format speed: the hand-written strict parser against ``http-sfv``, parse + validate and serialise.

This is the measurement behind the choice of a hand-written strict subset over ``http-sfv``. Both sides
do the same work: the http-sfv side parses with ``Dictionary().parse``, turns members into
plain values (rejecting parameters, which the subset has none of), and then runs *askonce's own*
validation (``wire.parse_question`` / ``wire.parse_reply`` with the dictionary parser swapped), so only
the structured-field layer differs.

    python bench/bench_wire.py            # prints a markdown table
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import http_sfv
from http_sfv.dictionary import Dictionary
from http_sfv.item import InnerList
from http_sfv.types import Token

from askonce.core import wire
from askonce.core.question import Hop, mint_key
from askonce.core.wire import Limits, Malformed, Reply

KEY = mint_key(1_700_000_000_000, bytes(range(16)))
PATH = (Hop("edge", 1), Hop("gateway", 2), Hop("orders", 1))
QUESTION = wire.format_question(KEY, "edge", True, 2, 2.5, PATH)
REPLY = Reply(0, True, "exhausted", 0.25)
REPLY_TEXT = wire.format_reply(REPLY)
LIMITS = Limits()


# --- the http-sfv side ----------------------------------------------------------------------------


def _plain(item: Any) -> wire.Item | None:
    if item.params:
        return None
    v = item.value
    if isinstance(v, Token):
        return wire.Token(v)
    if type(v) in (int, bool, str, bytes):
        return v  # type: ignore[no-any-return]
    return None  # decimals, dates, display strings: outside the subset


def sfv_dictionary(text: str) -> dict[str, wire.Value] | Malformed:
    """``wire.parse_dictionary``'s contract, implemented on http-sfv (same limits, same outputs)."""
    if len(text) > wire.MAX_HEADER_CHARS:
        return Malformed("too-long")
    if not text.isascii():
        return Malformed("not-ascii")
    d = Dictionary()
    try:
        d.parse(text.encode("ascii"))
    except ValueError:
        return Malformed("syntax")
    out: dict[str, wire.Value] = {}
    for k, member in d.items():
        if isinstance(member, InnerList):
            if member.params:
                return Malformed("syntax")
            items = [_plain(i) for i in member]
            if None in items:
                return Malformed("syntax")
            out[k] = [i for i in items if i is not None]
        else:
            value = _plain(member)
            if value is None:
                return Malformed("syntax")
            out[k] = value
    return out


@contextlib.contextmanager
def sfv_parser() -> Iterator[None]:
    """Run askonce's own validation on top of http-sfv: swap the dictionary parser that ``parse_*`` call."""
    saved = wire.parse_dictionary
    wire.parse_dictionary = sfv_dictionary
    try:
        yield
    finally:
        wire.parse_dictionary = saved


def sfv_format_question(key: str, origin: str, edge: bool, budget: int, remaining: float | None,
                        path: tuple[Hop, ...]) -> str:
    d = Dictionary()
    d["v"] = wire.VERSION
    d["k"] = key
    d["o"] = Token(origin)
    if edge:
        d["e"] = True
    d["b"] = max(0, min(budget, wire.MAX_BUDGET))
    if remaining is not None:
        d["d"] = max(0, min(int(remaining * 1000), wire.MAX_DEADLINE_MS))
    if path:
        d["p"] = InnerList([Token(f"{h.layer}:{h.attempt}") for h in path[-wire.MAX_HOPS:]])
    return str(d)


def sfv_format_reply(reply: Reply) -> str:
    d = Dictionary()
    d["v"] = wire.VERSION
    d["b"] = max(0, min(reply.budget, wire.MAX_BUDGET))
    if reply.dnr:
        d["dnr"] = True
    if reply.reason is not None:
        d["r"] = Token(reply.reason)
    if reply.pushback is not None:
        d["pb"] = max(0, min(int(reply.pushback * 1000), wire.MAX_DEADLINE_MS))
    return str(d)


# --- timing ---------------------------------------------------------------------------------------


Case = tuple[Callable[[], object], Callable[[], contextlib.AbstractContextManager[None]]]


def _loop(case: Case, n: int) -> tuple[float, float]:
    """(wall, CPU) ns per call over ``n`` calls, inside the case's context, the collector off."""
    fn, within = case
    gc.disable()
    try:
        with within():
            c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
            for _ in range(n):
                fn()
            t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        return (t1 - t0) / n, (c1 - c0) / n
    finally:
        gc.enable()


def measure(cases: dict[str, Case], rounds: int, sample_ms: float) -> dict[str, tuple[float, float]]:
    """Median (wall, CPU) ns/op per case; cases run interleaved in each round so drift hits them alike."""
    sizes = {}
    for name, case in cases.items():
        per = _loop(case, 200)[1]
        sizes[name] = max(100, int(sample_ms * 1e6 / max(per, 1.0)))
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, case in cases.items():
            samples[name].append(_loop(case, sizes[name]))
    return {name: (statistics.median(w for w, _ in s), statistics.median(c for _, c in s))
            for name, s in samples.items()}


def check_same_results() -> None:
    """The two sides must decode the same thing, or the comparison means nothing."""
    ours_q = wire.parse_question(QUESTION, 100.0, LIMITS)
    ours_r = wire.parse_reply(REPLY_TEXT)
    with sfv_parser():
        theirs_q = wire.parse_question(QUESTION, 100.0, LIMITS)
        theirs_r = wire.parse_reply(REPLY_TEXT)
    assert not isinstance(ours_q, Malformed) and ours_q == theirs_q, (ours_q, theirs_q)
    with sfv_parser():  # the general parser, as the comparison runs it, on both sides
        assert wire._parse_question_general(QUESTION, 100.0, LIMITS) == ours_q
    assert wire._parse_question_general(QUESTION, 100.0, LIMITS) == ours_q
    assert ours_r == theirs_r == REPLY, (ours_r, theirs_r)
    # ...and the swap must be in effect: a header only http-sfv accepts (a parenthesis in an inner-list string)
    odd = 'v=1, b=1, z=("x)")'
    assert isinstance(wire.parse_reply(odd), Malformed)
    with sfv_parser():
        assert wire.parse_reply(odd) == Reply(1)
    assert sfv_format_question(KEY, "edge", True, 2, 2.5, PATH) == QUESTION
    assert sfv_format_reply(REPLY) == REPLY_TEXT


def run(rounds: int, sample_ms: float) -> str:
    load_before = os.getloadavg()[0]
    check_same_results()
    # The general parser on both sides: parse_question would take the canonical fast path, which never
    # calls the dictionary parser, and so compares nothing (both sides would run the same regex).
    pq, pr, general = wire.parse_question, wire.parse_reply, wire._parse_question_general
    fq, fr = wire.format_question, wire.format_reply
    ours, sfv = contextlib.nullcontext, sfv_parser
    cases: dict[str, Case] = {
        "parse question (ours)": (lambda: general(QUESTION, 100.0, LIMITS), ours),
        "parse question (http-sfv)": (lambda: general(QUESTION, 100.0, LIMITS), sfv),
        "canonical fast path, `parse_question`": (lambda: pq(QUESTION, 100.0, LIMITS), ours),
        "canonical fast path into a Tab, `parse_frame`": (lambda: wire.parse_frame(QUESTION, 100.0, LIMITS), ours),
        "parse question dictionary only (ours)": (lambda: wire.parse_dictionary(QUESTION), ours),
        "parse question dictionary only (http-sfv)": (lambda: sfv_dictionary(QUESTION), ours),
        "parse reply (ours)": (lambda: pr(REPLY_TEXT), ours),
        "parse reply (http-sfv)": (lambda: pr(REPLY_TEXT), sfv),
        "format question (ours)": (lambda: fq(KEY, "edge", True, 2, 2.5, PATH), ours),
        "format question (http-sfv)": (lambda: sfv_format_question(KEY, "edge", True, 2, 2.5, PATH), ours),
        "format reply (ours)": (lambda: fr(REPLY), ours),
        "format reply (http-sfv)": (lambda: sfv_format_reply(REPLY), ours),
    }
    ns = measure(cases, rounds, sample_ms)

    lines = [
        f"### Wire format: hand-written strict subset vs http-sfv {http_sfv.__version__}",
        "",
        f"{datetime.date.today().isoformat()}, Python {platform.python_version()}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs, load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}; median of {rounds} "
        f"interleaved rounds of ~{sample_ms:.0f} ms each. Wall: `perf_counter_ns`; CPU: `thread_time_ns` "
        "(blind to other processes on a loaded machine).",
        "",
        f"Question header ({len(QUESTION)} chars, 3-hop path): `{QUESTION}`  ",
        f"Reply header: `{REPLY_TEXT}`",
        "",
        "| operation | askonce wall (ns/op) | http-sfv wall (ns/op) | askonce CPU | http-sfv CPU "
        "| http-sfv / askonce (wall, CPU) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for op in ("parse question", "parse question dictionary only", "parse reply", "format question",
               "format reply"):
        (ow, oc), (tw, tc) = ns[f"{op} (ours)"], ns[f"{op} (http-sfv)"]
        label = op if op.endswith("only") or not op.startswith("parse") else op + " + validate"
        if op == "parse question":
            label += " (general parser)"
        lines.append(f"| {label} | {ow:,.0f} | {tw:,.0f} "
                     f"| {oc:,.0f} | {tc:,.0f} | {tw / ow:.1f}x, {tc / oc:.1f}x |")
    lines += ["", "askonce only: what `format_question` writes, read by the canonical fast path (one regular "
              "expression; what every hop does with every request):", "",
              "| operation | askonce wall (ns/op) | askonce CPU |", "|---|---:|---:|"]
    for op in ("canonical fast path, `parse_question`", "canonical fast path into a Tab, `parse_frame`"):
        lines.append(f"| {op} | {ns[op][0]:,.0f} | {ns[op][1]:,.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--sample-ms", type=float, default=40.0)
    args = ap.parse_args(argv)
    print(run(args.rounds, args.sample_ms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
