"""The gRPC interceptors against metadata they cannot use, on real servers on 127.0.0.1 (sync and grpc.aio).

Server side: ``askonce-question`` metadata that cannot be used (too long, twice, empty, of version 9, with
absurd budgets and deadlines, or sent as binary ``askonce-question-bin``) is counted and the call answered
as if none came. Client side: a callee's trailing metadata with a malformed, duplicated or binary
``askonce-reply`` or a garbage ``grpc-retry-pushback-ms`` never crashes the client, is counted, and falls
back as documented (no reply: a status gRPC may have made itself is sent-and-lost, fail closed); a NaN
timeout is refused before any budget is held, an infinite one is bounded by the question.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from grpc import aio

import askonce
from askonce import Reply, RetryPolicy
from askonce.client import ClientPolicy
from askonce.core import wire
from askonce.core.backoff import NO_WAIT
from askonce.core.wire import QUESTION_HEADER, REPLY_HEADER
from askonce.integrations.grpc import (
    AskonceClientInterceptor,
    AskonceServerInterceptor,
    AsyncAskonceClientInterceptor,
    AsyncAskonceServerInterceptor,
    channel_options,
)
from grpc_servers import ServerSet, plain_call
from stats_delta import delta

Code = grpc.StatusCode
KEY = "01J9ZQ4M6T8V0XKD3C5B7N9P1R"
ECHO = "/askonce.test.Metadata/Echo"
SAYS = "/askonce.test.Metadata/Says"


def echo(request: bytes, ctx: Any) -> bytes:
    q = askonce.current()
    assert q is not None
    return json.dumps({"key": q.key, "budget": q.budget, "origin": q.origin}).encode()


def says(request: bytes, ctx: grpc.ServicerContext) -> bytes:
    """Answers with the status and trailing metadata the request asks for (JSON); counts arrivals."""
    asked = json.loads(request)
    with Servers.lock:
        Servers.arrivals += 1
    ctx.set_trailing_metadata(tuple((k, v.encode("latin-1") if k.endswith("-bin") else v)
                                    for k, v in asked["trailing"]))
    if asked["code"] != "OK":
        ctx.abort(Code[asked["code"]], "as asked")
    return b"ok"


async def aecho(request: bytes, ctx: Any) -> bytes:
    return echo(request, ctx)


def probe_service(handlers: dict[str, grpc.RpcMethodHandler]) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler("askonce.test.Metadata", handlers)


class Servers(ServerSet):
    lock = threading.Lock()
    arrivals = 0

    def __init__(self) -> None:
        super().__init__()
        self.urls: dict[str, str] = {}
        _, self.urls["sync"] = self.add_sync(probe_service({"Echo": grpc.unary_unary_rpc_method_handler(echo)}),
                                             interceptors=[AskonceServerInterceptor(layer="svc")])
        # no askonce: says what it is told to
        _, self.urls["plain"] = self.add_sync(probe_service({"Says": grpc.unary_unary_rpc_method_handler(says)}))
        _, self.urls["aio"] = self.add_aio(probe_service({"Echo": grpc.unary_unary_rpc_method_handler(aecho)}),
                                           interceptors=[AsyncAskonceServerInterceptor(layer="svc")])


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    s = Servers()
    yield s
    s.close()


def plain_echo(url: str, metadata: tuple[tuple[str, str | bytes], ...]) -> tuple[Code, dict[str, Any], Any]:
    """A call without askonce on the client: status, trailing metadata, and the handler's view."""
    code, trailing, body = plain_call(url, ECHO, metadata=metadata)
    return code, trailing, None if body is None else json.loads(body)


GOOD = f'v=1, k="{KEY}", o=edge, e, b=2, d=5000'
Q = QUESTION_HEADER
UNUSABLE = [
    ("4kB", ((Q, "v=1, x=" + "a" * 4000),), "malformed.question.too-long"),
    ("duplicate", ((Q, GOOD), (Q, GOOD)), "malformed.question.duplicate-header"),
    ("empty", ((Q, ""),), "malformed.question.version"),
    ("unknown-version", ((Q, f'v=9, k="{KEY}", o=edge, b=2'),), "malformed.question.version"),
    ("budget-1e30", ((Q, f'v=1, k="{KEY}", o=edge, b={10**30}'),), "malformed.question.syntax"),
    ("negative-budget", ((Q, f'v=1, k="{KEY}", o=edge, b=-1'),), "malformed.question.budget"),
    ("deadline-1e12", ((Q, f'v=1, k="{KEY}", o=edge, b=2, d={10**12}'),), "malformed.question.deadline"),
    ("binary", ((Q + "-bin", GOOD.encode()),), "malformed.question.binary"),
    ("binary-junk", ((Q + "-bin", b"\xff\x00\xfe"),), "malformed.question.binary"),
]


@pytest.mark.parametrize("server", ["sync", "aio"])
@pytest.mark.parametrize(("name", "metadata", "counter"), UNUSABLE, ids=[u[0] for u in UNUSABLE])
def test_question_metadata_that_cannot_be_used_is_counted_and_the_call_answered(
        servers: Servers, server: str, name: str, metadata: Any, counter: str) -> None:
    before = askonce.stats()
    code, trailing, seen = plain_echo(servers.urls[server], metadata)
    assert code == Code.OK
    assert wire.parse_reply(trailing[REPLY_HEADER]) == Reply(2)
    assert (seen["origin"], seen["budget"]) == ("svc", 2) and seen["key"] != KEY  # minted here
    assert delta(before) == {counter: 1}


@pytest.mark.parametrize("server", ["sync", "aio"])
def test_a_question_next_to_a_binary_one_is_used_and_the_binary_one_counted(servers: Servers, server: str) -> None:
    before = askonce.stats()
    code, _, seen = plain_echo(servers.urls[server], ((Q, GOOD), (Q + "-bin", b"\x00")))
    assert code == Code.OK and seen["key"] == KEY
    assert delta(before) == {"malformed.question.binary": 1}


# --- replies the client cannot use ----------------------------------------------------------------


def policy() -> ClientPolicy:
    return ClientPolicy(layer="orders", retry=RetryPolicy(attempts=3, backoff=NO_WAIT), bucket=None)


def ask(mode: str, url: str, code: str, trailing: list[tuple[str, str]], timeout: float = 5.0) -> Code:
    """One call through the askonce client interceptor to the plain server, inside the caller's question."""
    request = json.dumps({"code": code, "trailing": trailing}).encode()
    if mode == "sync":
        with grpc.insecure_channel(url, options=channel_options()) as ch:
            channel = grpc.intercept_channel(ch, AskonceClientInterceptor(policy(), idempotent=True))
            try:
                channel.unary_unary(SAYS)(request, timeout=timeout)
                return Code.OK
            except grpc.RpcError as e:
                return e.code()  # type: ignore[no-any-return]

    async def go() -> Code:
        interceptor = AsyncAskonceClientInterceptor(policy(), idempotent=True)
        async with aio.insecure_channel(url, options=channel_options(), interceptors=[interceptor]) as ch:
            try:
                await ch.unary_unary(SAYS)(request, timeout=timeout)
                return Code.OK
            except grpc.RpcError as e:
                return e.code()  # type: ignore[no-any-return]

    return asyncio.run(go())


R = REPLY_HEADER
BAD_REPLIES = [
    ("duplicate", [(R, "v=1, b=1"), (R, "v=1, b=1")], "malformed.reply.duplicate-header"),
    ("too-long", [(R, "v=1, b=0, x=" + "a" * 5000)], "malformed.reply.too-long"),
    ("budget-1e20", [(R, f"v=1, b={10**20}")], "malformed.reply.syntax"),
    ("negative-budget", [(R, "v=1, b=-2")], "malformed.reply.budget"),
    ("unknown-version", [(R, "v=9, b=0, dnr")], "malformed.reply.version"),
    ("binary", [(R + "-bin", "v=1, b=0, dnr")], "malformed.reply.binary"),
]


@pytest.mark.parametrize("mode", ["sync", "aio"])
@pytest.mark.parametrize(("name", "trailing", "counter"), BAD_REPLIES, ids=[b[0] for b in BAD_REPLIES])
def test_a_reply_that_cannot_be_used_is_counted_and_read_as_no_reply(
        servers: Servers, mode: str, name: str, trailing: list[tuple[str, str]], counter: str) -> None:
    url = servers.urls["plain"]
    # An answer (OK) without a usable reply: from a callee that says nothing, so all that was held comes back.
    before = askonce.stats()
    with askonce.question(budget=2):
        assert ask(mode, url, "OK", trailing) == Code.OK
        assert askonce.current().budget == 2  # type: ignore[union-attr]
    assert delta(before) == {counter: 1}
    # UNAVAILABLE without a usable reply: gRPC may have made it locally, so sent and lost (fail closed):
    # what was forwarded is forfeit, and nothing is left to retry with.
    Servers.arrivals = 0
    with askonce.question(budget=2):
        assert ask(mode, url, "UNAVAILABLE", trailing) == Code.UNAVAILABLE
        assert askonce.current().budget == 0  # type: ignore[union-attr]
    assert Servers.arrivals == 1


@pytest.mark.parametrize("mode", ["sync", "aio"])
@pytest.mark.parametrize("pushback", ["abc", "-5", "99999999999999", ""])
def test_a_pushback_that_is_not_a_small_number_means_do_not_retry(servers: Servers, mode: str, pushback: str) -> None:
    Servers.arrivals = 0
    with askonce.question(budget=2):
        trailing = [(R, "v=1, b=2"), ("grpc-retry-pushback-ms", pushback)]
        assert ask(mode, servers.urls["plain"], "UNAVAILABLE", trailing) == Code.UNAVAILABLE
        assert askonce.current().budget == 2  # type: ignore[union-attr]  # the reply said what is left
    assert Servers.arrivals == 1


@pytest.mark.parametrize("mode", ["sync", "aio"])
def test_a_nan_timeout_is_refused_before_any_budget_is_held(servers: Servers, mode: str) -> None:
    Servers.arrivals = 0
    with askonce.question(budget=2):
        with pytest.raises(ValueError, match="timeout"):
            ask(mode, servers.urls["plain"], "OK", [], timeout=float("nan"))
        assert askonce.current().budget == 2  # type: ignore[union-attr]
    assert Servers.arrivals == 0


@pytest.mark.parametrize("mode", ["sync", "aio"])
def test_an_infinite_timeout_is_bounded_by_the_question(servers: Servers, mode: str) -> None:
    with askonce.question(budget=2, deadline=5.0):
        assert ask(mode, servers.urls["plain"], "OK", [(R, "v=1, b=2")], timeout=float("inf")) == Code.OK
