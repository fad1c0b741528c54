"""askonce.integrations.grpc: real gRPC servers on 127.0.0.1 (sync and grpc.aio), sync and aio clients.

Services are generic handlers with bytes in and out, so no protoc step is needed. One service,
``askonce.test.Probe``, behaves by method:

    Echo        the question the handler sees, as JSON        Fail       UNAVAILABLE, always
    Exhausted   raises askonce.BudgetExhausted                Overloaded RESOURCE_EXHAUSTED
    Slow        sleeps (request: seconds), then answers       Stream     a response stream of two messages
    Downstream  calls its own Exhausted method through askonce, then aborts INTERNAL (request b"recover":
                answers OK instead)
    Pushback    RESOURCE_EXHAUSTED with grpc-retry-pushback-ms: 50 on a key's first arrival, then OK
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from grpc import aio

import askonce
from askonce import Backoff, Limits, Reply, RetryPolicy
from askonce.client import ClientPolicy, last_reply, replies
from askonce.core import wire
from askonce.core.backoff import NO_WAIT
from askonce.core.ledger import Ledger, LedgerPolicy
from askonce.core.retry import ANSWERED, LOST, REFUSED
from askonce.core.wire import QUESTION_HEADER, REPLY_HEADER
from askonce.integrations._server import LEDGER_LOCK
from askonce.integrations.grpc import (
    AskonceClientInterceptor,
    AskonceServerInterceptor,
    AsyncAskonceClientInterceptor,
    AsyncAskonceServerInterceptor,
    channel_options,
    judge_status,
)
from grpc_servers import ServerSet, plain_call

SERVICE = "askonce.test.Probe"
Code = grpc.StatusCode
CLIENTS = ["sync", "aio"]
SERVERS = ["sync", "aio"]


def method(name: str) -> str:
    return f"/{SERVICE}/{name}"


class Probe:
    """What the handlers saw; shared between the servers' threads and the test."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self.lock:
            self.arrivals: Counter[tuple[str, str | None]] = Counter()
            self.seen: list[dict[str, Any]] = []

    def arrive(self, name: str, ctx: Any) -> tuple[int, dict[str, Any]]:
        q = askonce.current()
        seen = {"method": name, "key": None if q is None else q.key, "budget": None if q is None else q.budget,
                "edge": None if q is None else q.edge, "path": [] if q is None else [str(h) for h in q.path],
                "left": None if q is None else q.remaining(time.monotonic()), "grpc_left": ctx.time_remaining()}
        with self.lock:
            self.arrivals[name, seen["key"]] += 1
            self.seen.append(seen)
            return self.arrivals[name, seen["key"]], seen

    def count(self, name: str) -> int:
        with self.lock:
            return sum(n for (m, _), n in self.arrivals.items() if m == name)


def exhausted() -> askonce.BudgetExhausted:
    return askonce.BudgetExhausted("spent", reply=Reply(0, True, "exhausted"), layer="db", key=None, attempts=3)


def sync_handlers(probe: Probe, self_url: Callable[[], str]) -> grpc.GenericRpcHandler:
    def echo(request: bytes, ctx: grpc.ServicerContext) -> bytes:
        return json.dumps(probe.arrive("Echo", ctx)[1]).encode()

    def fail(request: bytes, ctx: grpc.ServicerContext) -> bytes:
        probe.arrive("Fail", ctx)
        ctx.abort(Code.UNAVAILABLE, "failing")

    def exhaust(request: bytes, ctx: grpc.ServicerContext) -> bytes:
        probe.arrive("Exhausted", ctx)
        raise exhausted()

    def overloaded(request: bytes, ctx: grpc.ServicerContext) -> bytes:
        probe.arrive("Overloaded", ctx)
        ctx.abort(Code.RESOURCE_EXHAUSTED, "too busy")

    def pushback(request: bytes, ctx: grpc.ServicerContext) -> bytes:
        n, _ = probe.arrive("Pushback", ctx)
        if n == 1:
            ctx.set_trailing_metadata((("grpc-retry-pushback-ms", "50"),))
            ctx.abort(Code.RESOURCE_EXHAUSTED, "come back in 50 ms")
        return b"ok"

    def slow(request: bytes, ctx: grpc.ServicerContext) -> bytes:
        probe.arrive("Slow", ctx)
        time.sleep(float(request))
        return b"ok"

    def downstream(request: bytes, ctx: grpc.ServicerContext) -> bytes:
        probe.arrive("Downstream", ctx)
        with grpc.insecure_channel(self_url()) as ch:
            inner = grpc.intercept_channel(ch, AskonceClientInterceptor(policy(), idempotent=True))
            try:
                inner.unary_unary(method("Exhausted"))(b"", timeout=5)
            except grpc.RpcError:
                if request == b"recover":
                    return b"fallback"
                ctx.abort(Code.INTERNAL, "a dependency failed")
        return b"ok"

    def stream(request: bytes, ctx: grpc.ServicerContext) -> Iterator[bytes]:
        probe.arrive("Stream", ctx)
        yield b"one"
        yield b"two"

    unary = {"Echo": echo, "Fail": fail, "Exhausted": exhaust, "Overloaded": overloaded, "Pushback": pushback,
             "Slow": slow, "Downstream": downstream}
    handlers = {k: grpc.unary_unary_rpc_method_handler(v) for k, v in unary.items()}
    handlers["Stream"] = grpc.unary_stream_rpc_method_handler(stream)
    return grpc.method_handlers_generic_handler(SERVICE, handlers)


def aio_handlers(probe: Probe, self_url: Callable[[], str]) -> grpc.GenericRpcHandler:
    async def echo(request: bytes, ctx: Any) -> bytes:
        return json.dumps(probe.arrive("Echo", ctx)[1]).encode()

    async def fail(request: bytes, ctx: Any) -> bytes:
        probe.arrive("Fail", ctx)
        await ctx.abort(Code.UNAVAILABLE, "failing")

    async def exhaust(request: bytes, ctx: Any) -> bytes:
        probe.arrive("Exhausted", ctx)
        raise exhausted()

    async def overloaded(request: bytes, ctx: Any) -> bytes:
        probe.arrive("Overloaded", ctx)
        await ctx.abort(Code.RESOURCE_EXHAUSTED, "too busy")

    async def slow(request: bytes, ctx: Any) -> bytes:
        probe.arrive("Slow", ctx)
        await asyncio.sleep(float(request))
        return b"ok"

    async def downstream(request: bytes, ctx: Any) -> bytes:
        probe.arrive("Downstream", ctx)
        interceptor = AsyncAskonceClientInterceptor(policy(), idempotent=True)
        async with aio.insecure_channel(self_url(), interceptors=[interceptor]) as ch:
            try:
                await ch.unary_unary(method("Exhausted"))(b"", timeout=5)
            except grpc.RpcError:
                if request == b"recover":
                    return b"fallback"
                await ctx.abort(Code.INTERNAL, "a dependency failed")
        return b"ok"

    unary = {"Echo": echo, "Fail": fail, "Exhausted": exhaust, "Overloaded": overloaded, "Slow": slow,
             "Downstream": downstream}
    return grpc.method_handlers_generic_handler(
        SERVICE, {k: grpc.unary_unary_rpc_method_handler(v) for k, v in unary.items()})


class Servers(ServerSet):
    """A sync server and an aio server with the askonce interceptor, and a sync server without it."""

    def __init__(self) -> None:
        super().__init__()
        self.probe = Probe()
        self.ledger = Ledger(LedgerPolicy(window=86_400.0, cap=4))
        limits = Limits(max_budget=3, max_deadline=10.0)
        self.urls: dict[str, str] = {}
        _, self.urls["sync"] = self.add_sync(
            sync_handlers(self.probe, lambda: self.urls["sync"]), workers=8,
            interceptors=[AskonceServerInterceptor(layer="billing", limits=limits, ledger=self.ledger)])
        _, self.urls["plain"] = self.add_sync(sync_handlers(self.probe, lambda: self.urls["plain"]))
        _, self.urls["aio"] = self.add_aio(aio_handlers(self.probe, lambda: self.urls["aio"]),
                                           interceptors=[AsyncAskonceServerInterceptor(layer="billing", limits=limits)])


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    s = Servers()
    yield s
    s.close()


@pytest.fixture
def probe(servers: Servers) -> Probe:
    servers.probe.reset()
    return servers.probe


def policy(**kw: Any) -> ClientPolicy:
    kw.setdefault("retry", RetryPolicy(attempts=3, backoff=NO_WAIT))
    return ClientPolicy(layer="orders", bucket=None, **kw)


class Result:
    def __init__(self, value: bytes | None = None, error: grpc.RpcError | None = None,
                 reply: Reply | None = None) -> None:
        self.value, self.error, self.reply = value, error, reply

    @property
    def code(self) -> grpc.StatusCode:
        return Code.OK if self.error is None else self.error.code()

    def json(self) -> dict[str, Any]:
        assert self.value is not None
        return json.loads(self.value)  # type: ignore[no-any-return]


def call(mode: str, url: str, name: str, request: bytes = b"", *, p: ClientPolicy | None = None,
         timeout: float | None = 5.0, metadata: tuple[tuple[str, str], ...] = (), **kw: Any) -> Result:
    """One call through a fresh channel with the askonce client interceptor (its own event loop if aio)."""
    p = p or policy()
    if mode == "sync":
        with replies(), grpc.insecure_channel(url, options=channel_options()) as ch:
            channel = grpc.intercept_channel(ch, AskonceClientInterceptor(p, target=url, **kw))
            try:
                return Result(channel.unary_unary(method(name))(request, timeout=timeout, metadata=metadata))
            except grpc.RpcError as e:
                return Result(error=e, reply=last_reply())

    async def go() -> Result:
        interceptor = AsyncAskonceClientInterceptor(p, target=url, **kw)
        with replies():
            async with aio.insecure_channel(url, options=channel_options(), interceptors=[interceptor]) as ch:
                try:
                    return Result(await ch.unary_unary(method(name))(request, timeout=timeout, metadata=metadata))
                except grpc.RpcError as e:
                    return Result(error=e, reply=last_reply())

    return asyncio.run(go())


def question(budget: int = 2, deadline_ms: int = 5000) -> tuple[tuple[str, str], ...]:
    value = wire.format_question(askonce.propagation.new_key(), "edge", True, budget, deadline_ms / 1000)
    return ((QUESTION_HEADER, value),)


def parsed(trailing: dict[str, Any]) -> Reply:
    r = wire.parse_reply(trailing[REPLY_HEADER])
    assert isinstance(r, Reply), r
    return r


# --- the question in, the reply out ---------------------------------------------------------------


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("server", SERVERS)
def test_the_handler_sees_the_question_and_the_reply_settles_the_budget(client: str, server: str,
                                                                       servers: Servers, probe: Probe) -> None:
    with askonce.question(budget=2, deadline=4.0) as q:
        r = call(client, servers.urls[server], "Echo")
        after = askonce.current()
    seen = r.json()
    assert seen["key"] == q.key and seen["edge"] is True and seen["path"] == ["orders:1"]
    assert seen["budget"] == 2  # all that is left is forwarded, held until the reply came back
    assert 3.0 < seen["left"] <= 4.0 and 3.0 < seen["grpc_left"] <= 4.05  # the gRPC deadline is the question's
    # (gRPC's time_remaining() rounds its own clock: 4.0096 was seen for a 4.0 s deadline)
    assert after is not None and after.budget == 2  # the reply said nothing was spent: released in full


@pytest.mark.parametrize("client", CLIENTS)
def test_without_a_bound_question_each_call_is_a_question_of_its_own(client: str, servers: Servers,
                                                                     probe: Probe) -> None:
    first, second = (call(client, servers.urls["sync"], "Echo").json() for _ in range(2))
    assert first["key"] != second["key"] and first["edge"] is False  # local keys, minted by the "orders" layer
    assert first["budget"] == 2 and first["left"] <= 30.0


# --- retries on the client ------------------------------------------------------------------------


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("server", SERVERS)
def test_a_failing_server_sees_at_most_one_plus_budget_arrivals(client: str, server: str, servers: Servers,
                                                                probe: Probe) -> None:
    p = policy(retry=RetryPolicy(attempts=10, backoff=NO_WAIT))
    with askonce.question(budget=2) as q:
        r = call(client, servers.urls[server], "Fail", p=p, idempotent=True)
    assert r.code == Code.UNAVAILABLE
    assert probe.arrivals["Fail", q.key] == 3
    assert [s["path"] for s in probe.seen] == [["orders:1"], ["orders:2"], ["orders:3"]]
    assert [s["budget"] for s in probe.seen] == [2, 1, 0]
    assert r.reply == Reply(0, True, "exhausted")


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize(("kw", "metadata", "arrivals"), [
    ({}, (), 1),                                       # no verb says it is safe: sent once
    ({}, (("idempotency-key", "order-7"),), 3),        # the caller made it safe
    ({"idempotent": [method("Fail")]}, (), 3),
    ({"idempotent": lambda m: m.endswith("/Get")}, (), 1),
])
def test_non_idempotent_calls_are_not_repeated_once_sent(client: str, kw: dict[str, Any], metadata: Any,
                                                         arrivals: int, servers: Servers, probe: Probe) -> None:
    with askonce.question(budget=5):
        call(client, servers.urls["sync"], "Fail", metadata=metadata, **kw)
    assert probe.count("Fail") == arrivals


@pytest.mark.parametrize("client", CLIENTS)
def test_a_refused_connection_is_retried_even_when_not_idempotent(client: str) -> None:
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        url = f"127.0.0.1:{s.getsockname()[1]}"
    slept: list[float] = []
    p = policy(retry=RetryPolicy(attempts=3, backoff=Backoff(base=0.01, jitter=False)))
    with askonce.question(budget=5):
        r = call(client, url, "Echo", p=p, sleep=slept.append)
        left = askonce.current()
    assert r.code == Code.UNAVAILABLE and len(slept) == 2  # three attempts, none ever sent
    assert left is not None and left.budget == 3  # two retries spent; what was forwarded came back


@pytest.mark.parametrize("client", CLIENTS)
def test_a_call_lost_to_its_deadline_fails_closed(client: str, servers: Servers, probe: Probe) -> None:
    # A plain server sends no reply: after a timeout nobody can tell what the callee spent.
    p = policy(retry=RetryPolicy(attempts=1), attempt_timeout=0.2)
    with askonce.question(budget=2):
        r = call(client, servers.urls["plain"], "Slow", b"1.0", p=p)
        left = askonce.current()
    assert r.code == Code.DEADLINE_EXCEEDED
    assert left is not None and left.budget == 0  # the 2 forwarded are counted as spent


@pytest.mark.parametrize("client", CLIENTS)
def test_the_question_deadline_bounds_every_attempt_and_ends_the_retries(client: str, servers: Servers,
                                                                         probe: Probe) -> None:
    with askonce.question(budget=2, deadline=0.3):
        r = call(client, servers.urls["sync"], "Slow", b"0.6", timeout=10.0, idempotent=True)
    assert r.code == Code.DEADLINE_EXCEEDED and probe.count("Slow") == 1
    assert probe.seen[0]["grpc_left"] <= 0.35  # gRPC's time_remaining() may exceed what was sent by ~1 ms
    # lost to the deadline: the budget forwarded counts as spent (fail closed), which ends it before the clock
    assert r.reply == Reply(0, True, "exhausted")


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("server", ["sync", "plain"])
def test_resource_exhausted_is_not_retried_and_says_overloaded(client: str, server: str, servers: Servers,
                                                               probe: Probe) -> None:
    with askonce.question(budget=2):
        r = call(client, servers.urls[server], "Overloaded", idempotent=True)
        left = askonce.current()
    assert r.code == Code.RESOURCE_EXHAUSTED and probe.count("Overloaded") == 1
    assert r.reply == Reply(2, True, "overloaded")
    assert left is not None and left.budget == 2


@pytest.mark.parametrize("client", CLIENTS)
def test_resource_exhausted_with_grpc_pushback_is_retried_after_it(client: str, servers: Servers,
                                                                   probe: Probe) -> None:
    slept: list[float] = []
    with askonce.question(budget=2):
        r = call(client, servers.urls["plain"], "Pushback", idempotent=True, sleep=slept.append)
    assert r.code == Code.OK and probe.count("Pushback") == 2 and slept == [0.05]


OK_REPLY = (("askonce-reply", "v=1, b=1"),)
DNR_REPLY = (("askonce-reply", "v=1, b=0, dnr, r=exhausted"),)


@pytest.mark.parametrize(("code", "details", "trailing", "retryable", "delivery"), [
    (Code.UNAVAILABLE, "failed to connect to all addresses; last error: ...", (), True, REFUSED),
    (Code.UNAVAILABLE, "Socket closed", (), True, LOST),
    (Code.UNAVAILABLE, "failing", OK_REPLY, True, ANSWERED),
    (Code.UNAVAILABLE, "failing", (("grpc-retry-pushback-ms", "-1"),), False, LOST),
    (Code.DEADLINE_EXCEEDED, "Deadline Exceeded", (), True, LOST),
    (Code.DEADLINE_EXCEEDED, "shed", DNR_REPLY, True, ANSWERED),
    (Code.INTERNAL, "RST_STREAM", (), False, LOST),
    (Code.UNKNOWN, "Exception calling application", (), False, ANSWERED),
    (Code.ABORTED, "conflict", (), False, ANSWERED),
    (Code.RESOURCE_EXHAUSTED, "busy", (), False, ANSWERED),
    (Code.RESOURCE_EXHAUSTED, "busy", (("askonce-reply", "v=1, b=1, pb=200"),), True, ANSWERED),
])
def test_status_mapping(code: grpc.StatusCode, details: str, trailing: Any, retryable: bool, delivery: str) -> None:
    outcome = judge_status(code, details, trailing)
    assert outcome.failure is not None
    assert (outcome.failure.retryable, outcome.failure.delivery) == (retryable, delivery)


def test_two_replies_in_trailing_metadata_are_counted_and_ignored() -> None:
    before = askonce.stats().get("malformed.reply.duplicate-header", 0)
    outcome = judge_status(Code.UNAVAILABLE, "failing", OK_REPLY + DNR_REPLY)
    assert outcome.failure is not None and outcome.failure.reply is None and outcome.failure.delivery == LOST
    assert askonce.stats()["malformed.reply.duplicate-header"] == before + 1


@pytest.mark.parametrize(("code", "health"), [(Code.OK, True), (Code.NOT_FOUND, None),
                                              (Code.INVALID_ARGUMENT, None), (Code.PERMISSION_DENIED, None)])
def test_ok_and_the_callers_own_faults_are_answers(code: grpc.StatusCode, health: bool | None) -> None:
    outcome = judge_status(code, "", OK_REPLY)
    assert outcome.failure is None and outcome.health is health and outcome.reply == Reply(1)


# --- the server ------------------------------------------------------------------------------------


@pytest.mark.parametrize("server", SERVERS)
def test_a_give_up_escaping_a_handler_is_unavailable_with_dnr(server: str, servers: Servers, probe: Probe) -> None:
    code, trailing, _ = plain_call(servers.urls[server], method("Exhausted"), metadata=question(budget=3))
    assert code == Code.UNAVAILABLE
    assert parsed(trailing) == Reply(0, True, "exhausted")
    assert trailing["grpc-retry-pushback-ms"] == "-1"


RETRY_CONFIG = json.dumps({"methodConfig": [{"name": [{"service": SERVICE}], "retryPolicy": {
    "maxAttempts": 3, "initialBackoff": "0.01s", "maxBackoff": "0.05s", "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE"]}}]})


@pytest.mark.parametrize("server", SERVERS)
def test_grpcs_own_retry_policy_stops_at_a_dnr_reply(server: str, servers: Servers, probe: Probe) -> None:
    options = [("grpc.service_config", RETRY_CONFIG)]
    assert plain_call(servers.urls[server], method("Fail"), options=options)[0] == Code.UNAVAILABLE
    assert plain_call(servers.urls[server], method("Exhausted"), options=options)[0] == Code.UNAVAILABLE
    assert probe.count("Fail") == 3  # gRPC's retry policy at work...
    assert probe.count("Exhausted") == 1  # ...stopped by grpc-retry-pushback-ms: -1 on a dnr reply


@pytest.mark.parametrize("server", SERVERS)
@pytest.mark.parametrize(("request_", "code", "dnr"), [(b"", Code.INTERNAL, True), (b"recover", Code.OK, False)])
def test_a_handlers_own_error_after_a_downstream_give_up_passes_dnr_on(server: str, request_: bytes,
                                                                       code: grpc.StatusCode, dnr: bool,
                                                                       servers: Servers, probe: Probe) -> None:
    got, trailing, _ = plain_call(servers.urls[server], method("Downstream"), request_, question(budget=3))
    assert got == code  # the handler's own status is kept
    assert parsed(trailing).dnr is dnr  # a handler that recovered says nothing of the downstream give-up
    if dnr:
        assert parsed(trailing).reason == "exhausted"


@pytest.mark.parametrize("server", SERVERS)
def test_an_arrival_past_its_deadline_is_refused_before_the_handler_runs(server: str, servers: Servers,
                                                                         probe: Probe) -> None:
    code, trailing, _ = plain_call(servers.urls[server], method("Echo"), metadata=question(deadline_ms=0))
    assert code == Code.DEADLINE_EXCEEDED and parsed(trailing) == Reply(2, True, "deadline")
    assert probe.count("Echo") == 0


def test_the_ledger_counts_by_method_and_refuses_over_its_cap(servers: Servers, probe: Probe) -> None:
    md = question()
    codes = [plain_call(servers.urls["sync"], method("Echo"), metadata=md)[:2] for _ in range(5)]
    assert [c for c, _ in codes] == [Code.OK] * 4 + [Code.RESOURCE_EXHAUSTED]
    assert parsed(codes[-1][1]) == Reply(2, True, "cap") and probe.count("Echo") == 4
    with LEDGER_LOCK:
        report = servers.ledger.report(time.time())
    assert report.find(method("Echo")) is not None


def test_a_malformed_question_is_counted_and_a_local_key_minted(servers: Servers, probe: Probe) -> None:
    before = askonce.stats().get("malformed.question.budget", 0)
    bad = (("askonce-question", 'v=1, k="0123456789abcdefXYZ", o=x, b=-1'),)
    code, _, _ = plain_call(servers.urls["sync"], method("Echo"), metadata=bad)
    assert code == Code.OK and askonce.stats()["malformed.question.budget"] == before + 1
    assert probe.seen[0]["edge"] is False and probe.seen[0]["budget"] == 2


def test_response_streams_pass_through(servers: Servers, probe: Probe) -> None:
    with grpc.insecure_channel(servers.urls["sync"]) as ch:
        assert list(ch.unary_stream(method("Stream"))(b"", timeout=5, metadata=question())) == [b"one", b"two"]
    assert probe.seen[0]["key"] is None  # not bound: streaming handlers are left alone


# --- options -----------------------------------------------------------------------------------------


def test_channel_options_turn_grpcs_retries_off_and_refuse_a_retry_policy() -> None:
    assert channel_options([("grpc.max_send_message_length", 1024)]) == [
        ("grpc.max_send_message_length", 1024), ("grpc.enable_retries", 0)]
    assert channel_options([("grpc.enable_retries", 0)]) == [("grpc.enable_retries", 0)]
    for bad in ([("grpc.enable_retries", 1)], [("grpc.service_config", RETRY_CONFIG)],
                [("grpc.service_config", "{nope")]):
        with pytest.raises(ValueError):
            channel_options(bad)


@pytest.mark.parametrize("kw", [{"target": 7}, {"idempotent": "/a/B"}, {"retry_codes": [Code.OK]},
                                {"retry_codes": ["UNAVAILABLE"]}])
def test_client_options_are_validated(kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        AskonceClientInterceptor(policy(), **kw)


@pytest.mark.parametrize("kw", [{"layer": "no spaces"}, {"budget": -1}, {"ledger": object()}])
def test_server_options_are_validated(kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        AskonceServerInterceptor(**{"layer": "billing", **kw})


MISCONFIGURED: list[Any] = [
    pytest.param(lambda: AskonceClientInterceptor(idempotent=[1]), id="grpc idempotent holds a non-name"),  # type: ignore[list-item]
    pytest.param(lambda: AsyncAskonceClientInterceptor(idempotent={b"/a/B"}), id="aio grpc idempotent holds bytes"),  # type: ignore[arg-type]
    pytest.param(lambda: AskonceClientInterceptor(random=0.5), id="random not callable"),
]


@pytest.mark.parametrize("make", MISCONFIGURED)
def test_a_misconfiguration_is_refused_at_construction(make: Callable[[], object]) -> None:
    with pytest.raises(ValueError):
        make()
