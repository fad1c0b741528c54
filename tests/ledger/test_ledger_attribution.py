"""What the target's ledger says about real stacks: honest, a hop that retries without saying so, a hop
that re-mints keys, and unkeyed traffic. Real uvicorn servers on 127.0.0.1, real httpx clients."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

import askonce
from askonce.client import ClientPolicy
from askonce.core.ledger import Kind, OperationReport
from askonce.integrations.asgi import AskonceASGIMiddleware
from askonce.integrations.httpx import AskonceTransport
from askonce.ledger.store import MemoryLedger
from e2e_services import uvicorn_running

OPERATION = "GET /items/{item_id}"


def target_app(ledger: MemoryLedger) -> AskonceASGIMiddleware:
    async def item(request: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    return AskonceASGIMiddleware(Starlette(routes=[Route("/items/{item_id}", item)]), layer="target", ledger=ledger)


def hop_app(target: str) -> Starlette:
    """One hop, three behaviours: honest (askonce end to end), sneaky (forwards the header as it came but
    retries on its own three times, as a plain proxy or a client library's hidden retry would), remint
    (drops the question and calls with an askonce client that has nothing bound, so it mints its own)."""
    plain = httpx.AsyncClient(timeout=5.0)

    from askonce.integrations.httpx import AsyncAskonceTransport

    askonce_client = httpx.AsyncClient(
        transport=AsyncAskonceTransport(policy=ClientPolicy(layer="hop", bucket=None)), timeout=5.0)
    reminting = httpx.AsyncClient(
        transport=AsyncAskonceTransport(policy=ClientPolicy(layer="remint", bucket=None)), timeout=5.0)

    async def honest_route(request: Request) -> PlainTextResponse:
        r = await askonce_client.get(f"{target}/items/{request.path_params['n']}")
        return PlainTextResponse(r.text, status_code=r.status_code)

    async def sneaky_route(request: Request) -> PlainTextResponse:
        header = {"askonce-question": request.headers["askonce-question"]}
        for _ in range(3):  # "just to be safe": the same request, byte for byte
            r = await plain.get(f"{target}/items/{request.path_params['n']}", headers=header)
        return PlainTextResponse(r.text)

    async def remint_route(request: Request) -> PlainTextResponse:
        token = askonce._context.FRAME.set(None)  # this hop loses the question it was given
        try:
            r = await reminting.get(f"{target}/items/{request.path_params['n']}")
        finally:
            askonce._context.FRAME.reset(token)
        return PlainTextResponse(r.text)

    app = Starlette(routes=[Route("/honest/{n}", honest_route), Route("/sneaky/{n}", sneaky_route),
                            Route("/remint/{n}", remint_route)])
    return AskonceASGIMiddleware(app, layer="hop")  # type: ignore[return-value]


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[str, str, MemoryLedger]]:
    ledger = MemoryLedger()
    with uvicorn_running(target_app(ledger)) as target, uvicorn_running(hop_app(target)) as hop:
        yield hop, target, ledger


def ask(client: httpx.Client, url: str) -> None:
    with askonce.question(budget=2):
        assert client.get(url).status_code == 200


def report(ledger: MemoryLedger) -> OperationReport:
    found = ledger.report(time.time()).find(OPERATION)
    assert found is not None
    return found


def test_what_the_ledger_reads_from_each_kind_of_stack(stack: tuple[str, str, MemoryLedger]) -> None:
    hop, target, ledger = stack
    edge = httpx.Client(transport=AskonceTransport(policy=ClientPolicy(layer="edge", bucket=None)), timeout=5.0)

    for n in range(20):  # an honest stack: every question arrives once
        ask(edge, f"{hop}/honest/{n}")
    r = report(ledger)
    assert (r.arrivals, r.attributable, r.distinct_keys) == (20, 20, 20)
    assert r.amplification == 1.0 and r.coverage == 1.0 and r.undeclared_retries == 0

    for n in range(10):  # a hop that retries behind askonce's back: same key, same path, three times
        ask(edge, f"{hop}/sneaky/{n}")
    r = report(ledger)
    assert r.undeclared_retries == 20  # 30 arrivals of 10 (key, path) pairs
    assert r.amplification == pytest.approx(50 / 30)
    assert dict(r.retries_by) == {}  # no layer declared a retry, and none is named for the hidden ones

    for n in range(5):  # a hop that re-mints: its keys are not the originator's
        ask(edge, f"{hop}/remint/{n}")
    r = report(ledger)
    assert dict(r.reminted_by) == {"remint": 5}
    assert r.kinds[Kind.REMINTED] == 5 and r.coverage == pytest.approx(50 / 55)

    for n in range(4):  # traffic with no question at all
        assert httpx.get(f"{target}/items/{n}", timeout=5.0).status_code == 200
    r = report(ledger)
    assert r.kinds[Kind.UNKEYED] == 4 and r.arrivals == 59
    assert r.distinct_keys == 30  # unattributable arrivals never pass for questions
    assert r.coverage == pytest.approx(50 / 59)
