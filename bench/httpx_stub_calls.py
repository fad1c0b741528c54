"""Instructions per call of ``AskonceTransport`` over a stub inner transport, against its floor.

The floor is what carrying ``askonce-question`` costs at all: a plain ``httpx.Client`` sending a
constant header of the question's size. Every client sends through the same in-process stub
transport (no sockets), so what is counted is httpx and askonce, not the network. Each case runs in
a child under valgrind's cachegrind; a case's figure is a run of ``--large`` calls minus one of
``--small``, divided by the difference (start-up cancels out). Instruction counts hardly move with
the load of other processes, unlike timings.

Cases: ``bare`` (plain client), ``header`` (the floor), ``bound`` (``AskonceTransport`` inside a
bound question), ``minted`` (nothing bound: a question minted per call), and two that bound what
any transport doing the job must cost: ``wrap`` (a transport wrapping the stub that sets the
constant header) and ``essence`` (the least of the job written as a peer would: the header from the
bound question, the reply's budget read back; no retry loop, breaker or admission). Each ``--compare SRC`` runs
the askonce cases again with askonce imported from another source tree, in the same run.

    python bench/httpx_stub_calls.py                                  # about 3 min on 2 CPUs
    python bench/httpx_stub_calls.py --compare /path/to/other/checkout/src
    python bench/httpx_stub_calls.py --times                          # µs per call, no valgrind
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

VALGRIND = ("valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null")
KINDS = ("bare", "header", "bound", "minted", "wrap", "essence")
ASKONCE_KINDS = ("bound", "minted")


def calls(kind: str, n: int) -> None:
    """Child: ``n`` sequential GETs with one case's client over the stub."""
    import httpx

    import askonce
    from askonce import RetryPolicy
    from askonce._context import FRAME
    from askonce.client import ClientPolicy
    from askonce.core import wire
    from askonce.core.question import Hop, mint_key
    from askonce.integrations.httpx import AskonceTransport

    question = wire.format_question(mint_key(1_700_000_000_000, bytes(range(16))), "edge", True, 2,
                                    2.5, (Hop("edge", 1), Hop("gateway", 1)))
    policy = ClientPolicy(layer="bench", retry=RetryPolicy(attempts=3), bucket=None)

    class Stub(httpx.BaseTransport):
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            return httpx.Response(200, content=b"hello, world\n")

    class Wrap(httpx.BaseTransport):
        """The least a transport that writes the header does: wrap the inner one, set a constant."""

        def __init__(self, inner: httpx.BaseTransport) -> None:
            self.inner = inner

        def handle_request(self, request: httpx.Request) -> httpx.Response:
            request.headers["askonce-question"] = question
            return self.inner.handle_request(request)

    class Essence(Wrap):
        """The least of ``AskonceTransport``'s job, written as a peer would: the header from the
        bound question (its key, budget, time left and path, this layer's hop added), the reply's
        budget read back. No retry loop, breaker, admission, escrow, give-up record or idempotency
        check."""

        def handle_request(self, request: httpx.Request) -> httpx.Response:
            frame = FRAME.get()
            if frame is None:
                return self.inner.handle_request(request)
            tab, path = frame
            left = None if tab.deadline is None else tab.deadline - time.monotonic()
            request.headers["askonce-question"] = wire.format_question(
                tab.key, tab.origin, tab.edge, tab.account.left, left, (*path, hop))
            response = self.inner.handle_request(request)
            text = response.headers.get("askonce-reply")
            if text is not None:
                reply = wire.parse_reply(text)
                if type(reply) is wire.Reply and reply.budget < tab.account.left:
                    tab.account.left = reply.budget
            return response

    hop = Hop("bench", 1)
    client = {"bare": lambda: httpx.Client(transport=Stub()),
              "wrap": lambda: httpx.Client(transport=Wrap(Stub())),
              "essence": lambda: httpx.Client(transport=Essence(Stub())),
              "header": lambda: httpx.Client(transport=Stub(),
                                             headers={"askonce-question": question}),
              "bound": lambda: httpx.Client(transport=AskonceTransport(Stub(), policy=policy)),
              "minted": lambda: httpx.Client(transport=AskonceTransport(Stub(), policy=policy)),
              }[kind]()
    bound = (askonce.question(budget=2, deadline=600.0) if kind in ("bound", "essence")
             else None)
    with bound or contextlib.nullcontext(), client:
        for _ in range(n):
            client.get("http://stub/").raise_for_status()


def pieces(name: str, n: int) -> None:
    """Child: ``n`` runs of one piece of a bound call (``--pieces``), on a request built once."""
    import httpx

    import askonce
    from askonce import RetryPolicy
    from askonce.client import ClientPolicy, _answered, _Call, _heard
    from askonce.core.retry import ANSWERED, settle
    from askonce.core.wire import QUESTION_HEADER
    from askonce.integrations import httpx as ah

    policy = ClientPolicy(layer="bench", retry=RetryPolicy(attempts=3), bucket=None)

    class Stub(httpx.BaseTransport):
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            return httpx.Response(200, content=b"hello, world\n")

    transport = ah.AskonceTransport(Stub(), policy=policy)
    caller, client = transport.caller, httpx.Client(transport=transport)
    request = client.build_request("GET", "http://stub/")
    response = httpx.Response(200, content=b"hello, world\n")
    target = ah.default_target(request)
    with askonce.question(budget=2, deadline=600.0):
        exchange = ah._Exchange(request, policy, transport.wrapped)
        started: Any = caller._start(exchange, target, True)
        call, limit, _held, header = started
        handle = caller._admissions(target, policy.admission)  # type: ignore[arg-type, misc]
        tried = _answered(exchange, response, call)
        run: dict[str, Callable[[], object]] = {
            "nothing": lambda: None,
            "default_target": lambda: ah.default_target(request),
            "_Exchange()": lambda: ah._Exchange(request, policy, transport.wrapped),
            "_idempotent": lambda: ah._idempotent(request, policy),
            "Caller._start": lambda: caller._start(exchange, target, True),
            "_Call()": lambda: _Call(caller, exchange, target, True, 1.0),
            "store.admission": lambda: caller._admissions(target, policy.admission),  # type: ignore
            "admit": lambda: handle.admit(1.0, 0.5),
            "record": lambda: handle.record(1.0, success=True),
            "prepare": lambda: exchange.prepare(header, limit),
            "headers[...] =": lambda: request.headers.__setitem__(QUESTION_HEADER, header),
            "judge": lambda: exchange.judge(httpx.Response(200)),
            "httpx.Response()": lambda: httpx.Response(200),
            "_answered": lambda: _answered(exchange, response, call),
            "_heard": lambda: _heard(caller, call, tried),
            "settle": lambda: settle(call.tab.account, 0, ANSWERED, None),
        }
        piece = run[name]
        for _ in range(n):
            piece()


PIECES = ("nothing", "default_target", "_Exchange()", "_idempotent", "Caller._start", "_Call()",
          "store.admission", "admit", "record", "prepare", "headers[...] =", "judge",
          "httpx.Response()", "_answered", "_heard", "settle")


def times(n: int, rounds: int = 5) -> int:
    """CPU µs per call of each case in this process (no valgrind; the collector off), the best of
    ``rounds``: what the instruction counts are in time on this machine."""
    import gc
    import time

    best: dict[str, float] = {}
    for _ in range(rounds):
        for kind in KINDS:
            gc.collect()
            gc.disable()
            try:
                t0 = time.process_time()
                calls(kind, n)
                us = (time.process_time() - t0) / n * 1e6
            finally:
                gc.enable()
            best[kind] = min(best.get(kind, us), us)
    print(f"CPU µs per call in-process, best of {rounds} rounds of {n} calls.\n")
    print("| case | µs per call | over bare |\n|---|---:|---:|")
    for kind, us in best.items():
        print(f"| {kind} | {us:.1f} | {us - best['bare']:+.1f} |")
    return 0


def count(kind: str, n: int, src: str | None, mode: str = "--calls") -> int:
    """Instructions of one child run (cachegrind's ``I refs``)."""
    # One hash seed for every child: set and dict layouts, and so the counts, repeat.
    env = {**os.environ, "PYTHONHASHSEED": "0", **({"PYTHONPATH": src} if src else {})}
    done = subprocess.run([*VALGRIND, sys.executable, __file__, mode, kind, str(n)],
                          capture_output=True, text=True, timeout=900, check=True, env=env)
    for line in done.stderr.splitlines():
        label, _, value = line.split("==", 2)[-1].partition(":")
        if " ".join(label.split()) == "I refs":
            return int(value.split()[0].replace(",", ""))
    raise RuntimeError(f"no cachegrind summary in:\n{done.stderr[-2000:]}")


def main(small: int, large: int, compare: list[str], jobs: int, kinds: list[str]) -> int:
    here = os.environ.get("PYTHONPATH") or None
    cases = [(k, here, "this tree") for k in KINDS if k in kinds or k in ("bare", "header")]
    cases += [(k, src, src) for src in compare for k in ASKONCE_KINDS if k in kinds]
    with ThreadPoolExecutor(jobs) as pool:
        runs = {(k, label, n): pool.submit(count, k, n, src)
                for k, src, label in cases for n in (small, large)}
        per = {(k, label): (runs[(k, label, large)].result() - runs[(k, label, small)].result())
               / (large - small) for k, _, label in cases}
    bare, floor = per[("bare", "this tree")], per[("header", "this tree")]
    print(f"Instructions per call over a stub transport: {large} calls minus {small}.\n")
    print("| case | askonce from | instructions | over bare | x the floor |")
    print("|---|---|---:|---:|---:|")
    for (k, label), v in per.items():
        over = v - bare
        ratio = "" if k == "bare" else f"{over / (floor - bare):.2f}"
        print(f"| {k} | {label} | {v:,.0f} | {over:+,.0f} ({over / bare:+.1%}) | {ratio} |")
    return 0


def main_pieces(small: int, large: int, compare: list[str], jobs: int) -> int:
    trees = [(os.environ.get("PYTHONPATH") or None, "this tree"), *((c, c) for c in compare)]
    with ThreadPoolExecutor(jobs) as pool:
        runs = {(k, label, n): pool.submit(count, k, n, src, "--piece")
                for src, label in trees for k in PIECES for n in (small, large)}
        per = {(k, label): (runs[(k, label, large)].result() - runs[(k, label, small)].result())
               / (large - small) for _, label in trees for k in PIECES}
    print(f"Instructions per run of each piece, {large} runs minus {small} (the loop's own cost "
          "is the row 'nothing').\n")
    print("| piece | " + " | ".join(label for _, label in trees) + " |")
    print("|---|" + "---:|" * len(trees))
    for k in PIECES:
        print(f"| {k} | " + " | ".join(f"{per[(k, label)]:,.0f}" for _, label in trees) + " |")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--calls", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--piece", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--pieces", action="store_true",
                    help="instructions of each piece of a bound call instead (runs, not calls)")
    ap.add_argument("--small", type=int, default=100)
    ap.add_argument("--large", type=int, default=400)
    ap.add_argument("--kinds", default=",".join((*ASKONCE_KINDS, "wrap", "essence")),
                    help="cases to run besides bare and header, which always run")
    ap.add_argument("--compare", action="append", default=[], metavar="SRC",
                    help="also the askonce cases with askonce from this source tree")
    ap.add_argument("--jobs", type=int, default=2, help="children at once (default 2)")
    ap.add_argument("--times", action="store_true",
                    help="instead: CPU µs per call of each case, in this process (no valgrind)")
    args = ap.parse_args()
    if args.times:
        sys.exit(times(3000))
    elif args.calls:
        calls(args.calls[0], int(args.calls[1]))
    elif args.piece:
        pieces(args.piece[0], int(args.piece[1]))
    elif args.pieces:
        sys.exit(main_pieces(args.small * 10, args.large * 10, args.compare, args.jobs))
    else:
        sys.exit(main(args.small, args.large, args.compare, args.jobs, args.kinds.split(",")))
