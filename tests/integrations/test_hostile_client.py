"""A client cannot open a breaker for everyone: answers about its own questions are no verdict.

A real stack on 127.0.0.1: clients -> gateway (uvicorn, ASGI middleware, an httpx transport with a
circuit breaker) -> target (uvicorn, ASGI middleware, a ledger with a per-key cap). One hostile
client sends questions with a 1 ms deadline (the target sheds them: 503 ``r=deadline``) and re-sends
one key past the cap (429 ``r=cap``), interleaved with ten well-behaved clients. Those refusals are
about the hostile client's questions, so the gateway's breaker must not count them: the ten get
every answer, as they do without the hostile client.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

import httpx
import pytest

import askonce
from askonce import BreakerPolicy, RetryPolicy
from askonce.client import ClientPolicy
from askonce.core.backoff import NO_WAIT
from askonce.core.breaker import State
from askonce.core.ledger import Ledger, LedgerPolicy
from askonce.core.question import Hop
from askonce.core.wire import QUESTION_HEADER, REPLY_HEADER, format_question, parse_reply
from askonce.integrations.asgi import AskonceASGIMiddleware
from askonce.integrations.httpx import AsyncAskonceTransport
from askonce.propagation import new_key
from askonce.stores.memory import MemoryStore
from e2e_services import uvicorn_running

GOOD_CLIENTS, GOOD_EACH, HOSTILE = 10, 10, 200
# Opens on a quarter of 10 calls failing: far more eager than the default, so that counting the
# hostile client's refusals would open it at once.
BREAKER = BreakerPolicy(failure_rate=0.25, minimum_calls=10, window_size=20, open_for=30.0)


async def target_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await asyncio.sleep(0.005)  # longer than a 1 ms deadline: the middleware sheds those
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def gateway(target_url: str, store: MemoryStore) -> Any:
    policy = ClientPolicy(layer="gw", retry=RetryPolicy(attempts=2, backoff=NO_WAIT), breaker=BREAKER)
    client = httpx.AsyncClient(transport=AsyncAskonceTransport(policy=policy, store=store), timeout=5.0)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        r = await client.get(target_url + scope["path"])
        await send({"type": "http.response.start", "status": r.status_code, "headers": []})
        await send({"type": "http.response.body", "body": r.content})

    return AskonceASGIMiddleware(app, layer="gw")


def _reason(r: httpx.Response) -> str | None:
    raw = r.headers.get(REPLY_HEADER)
    reply = None if raw is None else parse_reply(raw)
    return getattr(reply, "reason", None)


def _run(with_hostile: bool) -> tuple[Counter[int], Counter[tuple[int, str | None]], State]:
    store = MemoryStore(time.monotonic)
    ledger = Ledger(LedgerPolicy(cap=2))
    target = AskonceASGIMiddleware(target_app, layer="target", ledger=ledger)
    with uvicorn_running(target) as target_url, uvicorn_running(gateway(target_url, store)) as gw:
        good: Counter[int] = Counter()
        hostile: Counter[tuple[int, str | None]] = Counter()
        capped_key = new_key()
        with httpx.Client(base_url=gw, timeout=10.0) as c:
            for i in range(HOSTILE):
                if with_hostile:
                    if i % 2:  # a fresh question whose deadline is 1 ms
                        header = format_question(new_key(), "evil", True, 2, 0.001)
                    else:  # the same key again and again: past the target's cap of 2
                        header = format_question(capped_key, "evil", True, 2, 5.0)
                    r = c.get("/x", headers={QUESTION_HEADER: header})
                    hostile[r.status_code, _reason(r)] += 1
                if i % (HOSTILE // GOOD_EACH) == 0:
                    for _ in range(GOOD_CLIENTS):
                        good[c.get("/x").status_code] += 1
        state = store.breaker(target_url, BREAKER).state(time.monotonic())
    return good, hostile, state


def test_a_hostile_client_does_not_change_what_the_others_get() -> None:
    quiet, _, _ = _run(with_hostile=False)
    good, hostile, state = _run(with_hostile=True)
    assert sum(quiet.values()) == sum(good.values()) == GOOD_CLIENTS * GOOD_EACH
    assert quiet[200] == GOOD_CLIENTS * GOOD_EACH
    assert good[200] >= quiet[200] - GOOD_CLIENTS * GOOD_EACH // 100  # within 1 point
    # The hostile client really was refused, for its questions' reasons, over and over.
    assert hostile[503, "deadline"] >= HOSTILE // 2 - 5, hostile
    # Past the cap: the target answers 429 r=cap; the gateway passes the status on.
    assert sum(n for (status, _), n in hostile.items() if status == 429) >= HOSTILE // 2 - 5, hostile
    assert state is State.CLOSED


async def _huge_retry_after(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"retry-after", b"1000000")]})
    await send({"type": "http.response.body", "body": b"come back in 11 days"})


def _service(target_url: str) -> Any:
    policy = ClientPolicy(layer="svc", retry=RetryPolicy(attempts=3, backoff=NO_WAIT, max_pushback=60.0))
    client = httpx.AsyncClient(transport=AsyncAskonceTransport(policy=policy, store=MemoryStore(time.monotonic)))

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        r = await client.get(target_url + "/x")
        await send({"type": "http.response.start", "status": 500 if r.status_code >= 500 else 200,
                    "headers": []})
        await send({"type": "http.response.body", "body": b""})

    return AskonceASGIMiddleware(app, layer="svc")


def test_a_dependencys_huge_retry_after_reaches_the_public_caller_clamped() -> None:
    with uvicorn_running(_huge_retry_after) as target_url, uvicorn_running(_service(target_url)) as svc:
        r = httpx.get(svc + "/x", timeout=10.0)
    reply = parse_reply(r.headers[REPLY_HEADER])
    assert r.status_code == 503
    assert getattr(reply, "dnr", False) and getattr(reply, "pushback", None) == 60.0
    assert r.headers["retry-after"] == "60"


# --- the public edge is a trust boundary ------------------------------------------------------------


class _Seen:
    """A target that fails every call and notes what each arrival's question said."""

    def __init__(self) -> None:
        self.arrivals: list[tuple[str, int, float | None, tuple[str, ...], bool]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        q = askonce.current()
        assert q is not None
        self.arrivals.append((q.key, q.budget, q.remaining(time.monotonic()),
                              tuple(map(str, q.path)), q.edge))
        await send({"type": "http.response.start", "status": 503, "headers": []})
        await send({"type": "http.response.body", "body": b""})


def _edge(target_url: str, **trust: Any) -> Any:
    # Retries as many times as the question allows: what bounds them is the budget it carries.
    policy = ClientPolicy(layer="edge", retry=RetryPolicy(attempts=50, backoff=NO_WAIT), bucket=None)
    client = httpx.AsyncClient(transport=AsyncAskonceTransport(policy=policy, store=MemoryStore(time.monotonic)))

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        r = await client.get(target_url + "/x")
        await send({"type": "http.response.start", "status": r.status_code, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    return AskonceASGIMiddleware(app, layer="edge", originator=True, budget=2, deadline=5.0, **trust)


FORGED = {"budget": 1000, "edge": True, "path": (Hop("admin", 7),)}


@pytest.mark.parametrize(("trust", "arrivals"), [({}, 3), ({"trust": False}, 3), ({"trust": True}, 11)])
def test_a_client_forging_its_question_gets_at_most_the_edges_own_budget(trust: dict[str, Any],
                                                                         arrivals: int) -> None:
    seen = _Seen()
    target = AskonceASGIMiddleware(seen, layer="target")
    key = new_key()
    header = format_question(key, "evil", True, FORGED["budget"], None, FORGED["path"])  # no deadline
    with uvicorn_running(target) as target_url, uvicorn_running(_edge(target_url, **trust)) as edge:
        assert httpx.get(edge + "/x", headers={QUESTION_HEADER: header}, timeout=30.0).status_code >= 500
    assert len(seen.arrivals) == arrivals  # 1 + budget: the edge's 2, or the clamp's 10 if trusted
    assert {a[0] for a in seen.arrivals} == {key}  # the key is kept: the ledger counts per question
    first = seen.arrivals[0]
    if not trust.get("trust"):
        assert first[1] == 2 and first[2] is not None and first[2] <= 5.0  # the edge's own deadline
        assert first[3] == ("edge:1",)  # the path restarts at the edge


def test_trust_is_a_bool_or_a_callable_and_a_raising_one_means_untrusted() -> None:
    with pytest.raises(ValueError, match="trust"):
        AskonceASGIMiddleware(target_app, layer="edge", trust="yes")  # type: ignore[arg-type]
    seen = _Seen()
    target = AskonceASGIMiddleware(seen, layer="target")

    def broken(scope: Any) -> bool:
        raise RuntimeError("auth backend down")

    before = askonce.stats().get("server.trust.error", 0)
    header = format_question(new_key(), "evil", True, 1000, None)
    with uvicorn_running(target) as target_url, \
            uvicorn_running(_edge(target_url, trust=broken)) as edge:
        httpx.get(edge + "/x", headers={QUESTION_HEADER: header}, timeout=30.0)
    assert len(seen.arrivals) == 3
    assert askonce.stats()["server.trust.error"] == before + 1


def test_a_cap_at_a_public_edge_needs_a_principal() -> None:
    capped = Ledger(LedgerPolicy(cap=3))
    with pytest.raises(ValueError, match="principal"):
        AskonceASGIMiddleware(target_app, layer="edge", originator=True, ledger=capped)
    AskonceASGIMiddleware(target_app, layer="edge", originator=True, ledger=capped,
                          principal=lambda scope: "tenant")
    AskonceASGIMiddleware(target_app, layer="edge", originator=True, ledger=capped, trust=True)
    AskonceASGIMiddleware(target_app, layer="inner", ledger=capped)  # trusted callers: as before


def test_an_adopted_key_is_signed_by_the_edge_so_the_target_can_attribute_it() -> None:
    secret = b"the originators' shared secret, 32 bytes"
    seen = _Seen()
    ledger = Ledger(LedgerPolicy())
    target = AskonceASGIMiddleware(seen, layer="target", ledger=ledger, edge_secret=secret)
    header = format_question(new_key(), "evil", True, 1000, None)  # claims to be an edge key, unsigned
    with uvicorn_running(target) as target_url, \
            uvicorn_running(_edge(target_url, edge_secret=secret)) as edge:
        httpx.get(edge + "/x", headers={QUESTION_HEADER: header}, timeout=30.0)
    totals = ledger.report(time.time()).totals()
    assert len(seen.arrivals) == 3 and all(a[4] for a in seen.arrivals)  # edge keys, at the target...
    assert totals.arrivals == totals.attributable == 3  # ...that verify: the edge signed what it adopted
