"""Sync handlers on a grpc.aio server (grpc.aio runs them in its migration thread pool) behind the askonce
aio server interceptor: they are served with the question bound, keep their own trailing metadata and
status, and a late arrival is refused before the handler runs. A real server on 127.0.0.1.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

import askonce
from askonce import Reply
from askonce.core import wire
from askonce.core.wire import QUESTION_HEADER, REPLY_HEADER
from askonce.integrations.grpc import AsyncAskonceServerInterceptor
from grpc_servers import ServerSet, plain_call

Code = grpc.StatusCode
KEY = "01J9ZQ4M6T8V0XKD3C5B7N9P1R"
SERVICE = "askonce.test.Mixed"
COUNTS = f"/{SERVICE}/Counts"


def echo(request: bytes, ctx: Any) -> bytes:
    q = askonce.current()
    assert q is not None
    return json.dumps({"key": q.key, "budget": q.budget, "origin": q.origin}).encode()


def exhaust(request: bytes, ctx: Any) -> bytes:
    raise askonce.BudgetExhausted("spent", reply=Reply(0, True, "exhausted"), layer="db", key=None, attempts=3)


def aborts(request: bytes, ctx: Any) -> bytes:
    ctx.set_trailing_metadata((("x-mine", "1"),))
    ctx.abort(Code.FAILED_PRECONDITION, "the handler's own")
    raise AssertionError("abort returned")


def sets_code(request: bytes, ctx: Any) -> bytes:
    ctx.set_trailing_metadata((("x-mine", "1"),))
    ctx.set_code(Code.INTERNAL)
    ctx.set_details("set, not raised")
    return b""


def count_in(requests: Iterator[bytes], ctx: Any) -> bytes:
    q = askonce.current()
    assert q is not None
    return f"{sum(1 for _ in requests)} {q.key}".encode()


def counts(request: bytes, ctx: Any) -> bytes:
    with Servers.lock:
        Servers.arrivals += 1
    return b"ran"


SYNC_ON_AIO = {"Echo": echo, "Exhausted": exhaust, "Aborts": aborts, "SetsCode": sets_code, "Counts": counts}


class Servers(ServerSet):
    lock = threading.Lock()
    arrivals = 0

    def __init__(self) -> None:
        super().__init__()
        self.urls: dict[str, str] = {}
        # sync handlers on an aio server: grpc.aio runs them in its migration thread pool
        _, self.urls["mixed"] = self.add_aio(grpc.method_handlers_generic_handler(SERVICE, {
            **{k: grpc.unary_unary_rpc_method_handler(v) for k, v in SYNC_ON_AIO.items()},
            "Count": grpc.stream_unary_rpc_method_handler(count_in)}),
            interceptors=[AsyncAskonceServerInterceptor(layer="svc")], migration_workers=4)


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    s = Servers()
    yield s
    s.close()


GOOD = f'v=1, k="{KEY}", o=edge, e, b=2, d=5000'
Q = QUESTION_HEADER


@pytest.mark.parametrize(("name", "code", "reply", "mine"), [
    ("Echo", Code.OK, Reply(2), False),
    ("Exhausted", Code.UNAVAILABLE, Reply(0, True, "exhausted"), False),
    ("Aborts", Code.FAILED_PRECONDITION, Reply(2), True),
    ("SetsCode", Code.INTERNAL, Reply(2), True),
])
def test_sync_handlers_on_an_aio_server_are_served(servers: Servers, name: str, code: Code, reply: Reply,
                                                   mine: bool) -> None:
    got, trailing, body = plain_call(servers.urls["mixed"], f"/{SERVICE}/{name}", metadata=((Q, GOOD),))
    assert got == code
    assert wire.parse_reply(trailing[REPLY_HEADER]) == reply
    assert ("x-mine" in trailing) == mine  # the handler's own trailing metadata is kept
    if name == "Echo":
        assert body is not None and json.loads(body)["key"] == KEY


def test_a_sync_stream_unary_handler_on_an_aio_server_is_served(servers: Servers) -> None:
    with grpc.insecure_channel(servers.urls["mixed"]) as ch:
        body, call = ch.stream_unary(f"/{SERVICE}/Count").with_call(iter([b"a", b"b", b"c"]), timeout=5,
                                                                    metadata=((Q, GOOD),))
    assert body == f"3 {KEY}".encode()
    assert wire.parse_reply(dict(call.trailing_metadata())[REPLY_HEADER]) == Reply(2)


def test_a_late_arrival_is_refused_before_a_sync_handler_on_an_aio_server_runs(servers: Servers) -> None:
    Servers.arrivals = 0
    assert plain_call(servers.urls["mixed"], COUNTS, metadata=((Q, GOOD),))[0] == Code.OK
    assert Servers.arrivals == 1  # the handler counts when it runs
    got, trailing, _ = plain_call(servers.urls["mixed"], COUNTS, metadata=((Q, f'v=1, k="{KEY}", o=edge, b=1, d=0'),))
    assert got == Code.DEADLINE_EXCEEDED
    assert wire.parse_reply(trailing[REPLY_HEADER]) == Reply(1, True, "deadline")
    assert Servers.arrivals == 1  # refused before it ran
