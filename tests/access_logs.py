"""Access logs for the ``askonce audit`` tests: question headers, a seeded stack's traffic, the same
arrivals as JSON lines and as nginx lines, and what a live target's ledger would have counted of them."""

from __future__ import annotations

import json
import random
import time

from askonce.core import wire
from askonce.core.ledger import Ledger, LedgerPolicy
from askonce.core.question import Hop

T0 = 1_700_000_000.0
POLICY = LedgerPolicy(window=60.0, windows_kept=10)


def header(key: str, path: tuple[tuple[str, int], ...] = (("edge", 1),), edge: bool = True,
           origin: str = "edge") -> str:
    return wire.format_question(key, origin, edge, 2, 1.5, tuple(Hop(*h) for h in path))


def key(i: int) -> str:
    return f"question-{i:08d}-xyz"


def traffic(seed: int, n: int) -> list[tuple[float, str, str | None, str]]:
    """(time, operation, header or None, principal): a stack with one retrying hop, a re-minting one, junk."""
    rng = random.Random(seed)
    out: list[tuple[float, str, str | None, str]] = []
    for i in range(n):
        t = T0 + i * 0.1
        op = rng.choice(["GET /items/{id}", "POST /orders"])
        roll = rng.random()
        if roll < 0.7:
            for attempt in range(1, rng.choice([1, 1, 1, 2, 3]) + 1):
                out.append((t, op, header(key(i), (("edge", 1), ("gw", attempt))), rng.choice(["", "t1"])))
        elif roll < 0.8:
            out.append((t, op, header(key(i)), ""))
            out.append((t, op, header(key(i)), ""))  # a hop that retried without saying so
        elif roll < 0.9:
            out.append((t, op, header(f"local-{i:08d}-abcdef", edge=False, origin="mid"), ""))
        elif roll < 0.97:
            out.append((t, op, None, ""))
        else:
            out.append((t, op, "v=1, k=oops", ""))
    return out


def live(items: list[tuple[float, str, str | None, str]]) -> Ledger:
    """What a live target running the ledger would have counted for the same arrivals."""
    ledger = Ledger(POLICY)
    for t, op, h, principal in items:
        q = None if h is None else wire.parse_question(h, 0.0)
        if q is None:
            ledger.record(t, op, key=None, principal=principal)
        elif isinstance(q, wire.Malformed):
            ledger.record(t, op, key=None, principal=principal, malformed=True)
        else:
            ledger.record(t, op, key=q.key, edge=q.edge, origin=q.origin, path=q.path, principal=principal)
    return ledger


def jsonl(items: list[tuple[float, str, str | None, str]]) -> list[bytes]:
    return [json.dumps({"time": t, "operation": op, "askonce_question": h, "principal": p}).encode() + b"\n"
            for t, op, h, p in items]


def nginx(t: float, request: str, h: str | None, escape: str = "default") -> bytes:
    stamp = time.strftime("%d/%b/%Y:%H:%M:%S +0000", time.gmtime(t))
    value = "-" if h is None else h.replace('"', "\\x22" if escape == "default" else '\\"')
    return f'10.0.0.1 - - [{stamp}] "{request}" 200 5 "-" "curl/8.0" "{value}"\n'.encode()
