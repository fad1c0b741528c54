"""Joins at a gRPC callee: real servers on 127.0.0.1, sync, ``grpc.aio``, and sync handlers on aio.

Each server is ``[AskonceServerInterceptor(ledger=...), JoinServerInterceptor()]`` (or the aio
pair): the ledger counts every arrival, the handler counts its runs per (method, key). Services are
generic handlers with bytes in and out. ``askonce.test.Join`` by method:

    Slow     sleeps SLOW, then answers "answer to <request>"     Quick    answers at once, the same
    Missing  NOT_FOUND with trailing metadata x-why: gone         Fail     UNAVAILABLE, always
    Big      answers 2 kB                                         GiveUp   sleeps SLOW, then raises
    Lazy     sets NOT_FOUND and returns                                    BudgetExhausted
    Double   int in, twice it out (its own (de)serializers)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from grpc import aio

import askonce
from askonce.client import ClientPolicy
from askonce.core.join import JoinPolicy
from askonce.core.ledger import LedgerPolicy
from askonce.core.wire import QUESTION_HEADER, REPLY_HEADER, Reply, format_question, parse_reply
from askonce.integrations._join import Run
from askonce.integrations.grpc import (
    AskonceClientInterceptor,
    AskonceServerInterceptor,
    AsyncAskonceClientInterceptor,
    AsyncAskonceServerInterceptor,
    channel_options,
)
from askonce.integrations.grpc_join import (
    JOINED,
    AsyncJoinServerInterceptor,
    JoinServerInterceptor,
)
from askonce.ledger.store import MemoryLedger
from askonce.propagation import new_key
from grpc_servers import ServerSet
from stats_delta import delta

SERVICE = "askonce.test.Join"
Code = grpc.StatusCode
KINDS = ["sync", "aio", "sync-on-aio"]
SLOW = 1.0  # seconds a run of Slow takes: longer than the client's attempt timeout
TIMEOUT = 0.4  # the askonce client's per-attempt gRPC timeout


# How long at most an aborting handler's frame keeps unwinding after its abort, until the test
# releases it (an aio server sends the status at once; a sync one after the unwind).
UNWIND = 10.0


def method(name: str) -> str:
    return f"/{SERVICE}/{name}"


def _exhausted() -> askonce.BudgetExhausted:
    return askonce.BudgetExhausted("spent", reply=Reply(0, True, "exhausted"), layer="db",
                                   key=None, attempts=3)


class Work:
    """The handlers' side effect: runs per (method, key)."""

    def __init__(self) -> None:
        self.runs: Counter[tuple[str, str]] = Counter()
        self.lock = threading.Lock()
        self.unwound = threading.Event()  # lets an aborting handler's frame unwind (FailSlowly)

    def run(self, name: str) -> None:
        q = askonce.current()
        with self.lock:
            self.runs[name, q.key if q is not None else "-"] += 1

    def of(self, key: str) -> int:
        with self.lock:
            return sum(n for (_, k), n in self.runs.items() if k == key)


def sync_service(work: Work) -> grpc.GenericRpcHandler:
    def slow(request: bytes, ctx: Any) -> bytes:
        work.run("Slow")
        time.sleep(SLOW)
        return b"answer to " + request

    def quick(request: bytes, ctx: Any) -> bytes:
        work.run("Quick")
        return b"answer to " + request

    def missing(request: bytes, ctx: Any) -> bytes:
        work.run("Missing")
        ctx.set_trailing_metadata((("x-why", "gone"),))
        ctx.abort(Code.NOT_FOUND, "no such order")

    def fail(request: bytes, ctx: Any) -> bytes:
        work.run("Fail")
        ctx.abort(Code.UNAVAILABLE, "failing")

    def fail_slowly(request: bytes, ctx: Any) -> bytes:
        work.run("FailSlowly")
        try:
            ctx.abort(Code.UNAVAILABLE, "failing")
        finally:
            work.unwound.wait(UNWIND)

    def big(request: bytes, ctx: Any) -> bytes:
        work.run("Big")
        return b"x" * 2048

    def give_up(request: bytes, ctx: Any) -> bytes:
        work.run("GiveUp")
        time.sleep(SLOW)
        raise _exhausted()

    def lazy(request: bytes, ctx: Any) -> bytes:
        work.run("Lazy")
        ctx.set_code(Code.NOT_FOUND)
        ctx.set_details("not yet")
        return b""

    def double(request: int, ctx: Any) -> int:
        work.run("Double")
        return 2 * request

    unary = {"Slow": slow, "Quick": quick, "Missing": missing, "Fail": fail, "Big": big,
             "GiveUp": give_up, "Lazy": lazy, "FailSlowly": fail_slowly}
    return _service(unary, double)


def _service(unary: dict[str, Any], double: Any) -> grpc.GenericRpcHandler:
    handlers = {k: grpc.unary_unary_rpc_method_handler(v) for k, v in unary.items()}
    handlers["Double"] = grpc.unary_unary_rpc_method_handler(  # messages that are not bytes
        double, request_deserializer=int, response_serializer=lambda n: str(n).encode())
    return grpc.method_handlers_generic_handler(SERVICE, handlers)


def aio_service(work: Work) -> grpc.GenericRpcHandler:
    async def slow(request: bytes, ctx: Any) -> bytes:
        work.run("Slow")
        await asyncio.sleep(SLOW)
        return b"answer to " + request

    async def quick(request: bytes, ctx: Any) -> bytes:
        work.run("Quick")
        return b"answer to " + request

    async def missing(request: bytes, ctx: Any) -> bytes:
        work.run("Missing")
        await ctx.abort(Code.NOT_FOUND, "no such order", (("x-why", "gone"),))

    async def fail(request: bytes, ctx: Any) -> bytes:
        work.run("Fail")
        await ctx.abort(Code.UNAVAILABLE, "failing")

    async def fail_slowly(request: bytes, ctx: Any) -> bytes:
        work.run("FailSlowly")
        try:
            await ctx.abort(Code.UNAVAILABLE, "failing")
        finally:
            for _ in range(int(UNWIND / 0.01)):
                if work.unwound.is_set():
                    break
                await asyncio.sleep(0.01)

    async def big(request: bytes, ctx: Any) -> bytes:
        work.run("Big")
        return b"x" * 2048

    async def give_up(request: bytes, ctx: Any) -> bytes:
        work.run("GiveUp")
        await asyncio.sleep(SLOW)
        raise _exhausted()

    async def lazy(request: bytes, ctx: Any) -> bytes:
        work.run("Lazy")
        ctx.set_code(Code.NOT_FOUND)
        ctx.set_details("not yet")
        return b""

    async def double(request: int, ctx: Any) -> int:
        work.run("Double")
        return 2 * request

    unary = {"Slow": slow, "Quick": quick, "Missing": missing, "Fail": fail, "Big": big,
             "GiveUp": give_up, "Lazy": lazy, "FailSlowly": fail_slowly}
    return _service(unary, double)


class Callee:
    """One server of a kind, with its join table, ledger and work."""

    def __init__(self, kind: str, **join: Any) -> None:
        # One window of a day: the calls of a test never straddle two windows of `find`.
        self.kind, self.work = kind, Work()
        self.ledger = MemoryLedger(LedgerPolicy(window=86_400.0))
        self.servers = ServerSet()
        if kind == "sync":
            self.join: Any = JoinServerInterceptor(**join)
            outer: Any = AskonceServerInterceptor(layer="target", ledger=self.ledger)
            _, self.url = self.servers.add_sync(sync_service(self.work), workers=16,
                                                interceptors=[outer, self.join])
        else:
            self.join = AsyncJoinServerInterceptor(**join)
            outer = AsyncAskonceServerInterceptor(layer="target", ledger=self.ledger)
            service = aio_service(self.work) if kind == "aio" else sync_service(self.work)
            _, self.url = self.servers.add_aio(
                service, interceptors=[outer, self.join],
                migration_workers=16 if kind == "sync-on-aio" else None)

    def arrivals(self, name: str) -> int:
        op = self.ledger.report(time.time()).find(method(name))
        return 0 if op is None else op.arrivals

    def close(self) -> None:
        self.servers.close()


@pytest.fixture(params=KINDS)
def callee(request: pytest.FixtureRequest) -> Iterator[Callee]:
    c = Callee(request.param)
    yield c
    c.close()


class Answered:
    def __init__(self, code: grpc.StatusCode, details: str | None, trailing: Any,
                 body: bytes | None) -> None:
        self.code, self.details, self.body = code, details, body
        self.trailing = dict(trailing or ())

    @property
    def reply(self) -> Reply:
        reply = parse_reply(self.trailing[REPLY_HEADER])
        assert isinstance(reply, Reply), reply
        return reply

    @property
    def joined(self) -> str | None:
        return self.trailing.get(JOINED)


def header(key: str, budget: int = 2, rejoin: bool = False) -> str:
    return format_question(key, "edge", True, budget, 10.0, (), None, rejoin=rejoin)


def plain(url: str, name: str, request: bytes = b"q", *, key: str | None = None,
          rejoin: bool = False, timeout: float = 10.0,
          metadata: tuple[tuple[str, str], ...] = ()) -> Answered:
    """A call without askonce on the client side, carrying ``key``'s question."""
    sent = metadata if key is None else ((QUESTION_HEADER, header(key, rejoin=rejoin)), *metadata)
    with grpc.insecure_channel(url) as ch:
        unary: Any = ch.unary_unary(method(name))
        try:
            body, call = unary.with_call(request, timeout=timeout, metadata=sent)
            return Answered(call.code(), call.details(), call.trailing_metadata(), body)
        except grpc.RpcError as e:
            return Answered(e.code(), e.details(), e.trailing_metadata(), None)


# --- one run per question ---------------------------------------------------------------------------


def test_concurrent_calls_of_one_question_run_the_handler_once_and_all_get_its_answer(
        callee: Callee) -> None:
    key, n = new_key(), 6
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        got = list(pool.map(lambda _: plain(callee.url, "Slow", key=key), range(n)))
    for _ in range(50):  # once the run is marked done (a moment after its answer), a replay
        late = plain(callee.url, "Slow", key=key)
        if late.joined == "replay":
            break
    assert callee.work.runs["Slow", key] == 1
    assert [a.code for a in got] == [Code.OK] * n and {a.body for a in got} == {b"answer to q"}
    # One ran; the others joined it (those that came after it ended got it replayed).
    assert sorted(str(a.joined) for a in got).count("None") == 1
    assert all(a.joined in (None, "wait", "replay") for a in got)
    assert late.code == Code.OK and late.body == b"answer to q" and late.joined == "replay"
    assert all(a.reply.joins for a in [*got, late])  # every reply says the callee joins
    assert callee.arrivals("Slow") == n + 1  # the ledger counts every arrival...
    op = callee.ledger.report(time.time()).find(method("Slow"))
    assert op is not None and op.joined == n and op.work_per_question == 1.0  # ...and the runs


def test_a_kept_error_is_replayed_with_its_details_and_trailing_metadata(callee: Callee) -> None:
    key = new_key()
    first, again = (plain(callee.url, "Missing", key=key) for _ in range(2))
    assert callee.work.runs["Missing", key] == 1
    for a in (first, again):
        assert (a.code, a.details, a.trailing.get("x-why")) == (Code.NOT_FOUND, "no such order",
                                                                "gone")
    # The second call comes after the first's answer, and may still find its run finishing (on a
    # loaded machine the answer reaches the caller before the run is marked done): either way
    # joined, never run again.
    assert first.joined is None and again.joined in ("wait", "replay") and again.reply.joins


def test_a_status_set_without_raising_is_kept_and_replayed(callee: Callee) -> None:
    key = new_key()
    first, again = (plain(callee.url, "Lazy", key=key) for _ in range(2))
    assert [(a.code, a.details) for a in (first, again)] == [(Code.NOT_FOUND, "not yet")] * 2
    assert first.joined is None and again.joined in ("wait", "replay")  # (see above)
    assert callee.work.runs["Lazy", key] == 1


def test_messages_are_compared_and_kept_serialized_with_the_methods_own_codecs(
        callee: Callee) -> None:
    key, before = new_key(), askonce.stats()
    first, again = (plain(callee.url, "Double", b"21", key=key) for _ in range(2))
    other = plain(callee.url, "Double", b"22", key=key)
    unreadable = plain(callee.url, "Double", b"twenty", key=new_key())
    assert (first.body, again.body) == (b"42", b"42") and again.joined in ("wait", "replay")
    assert other.code == Code.FAILED_PRECONDITION and callee.work.runs["Double", key] == 1
    # What gRPC itself answers for a request its deserializer refuses; the handler never runs.
    assert (unreadable.code, unreadable.details) == (Code.INTERNAL,
                                                     "Exception deserializing request!")
    assert sum(n for (m, _), n in callee.work.runs.items() if m == "Double") == 1
    assert delta(before).get("server.join.unreadable") == 1


def test_a_failed_answer_is_not_replayed_so_a_retry_really_runs(callee: Callee) -> None:
    key = new_key()
    a, b = (plain(callee.url, "Fail", key=key) for _ in range(2))
    assert a.code == b.code == Code.UNAVAILABLE and (a.details, b.details) == ("failing",) * 2
    assert callee.work.runs["Fail", key] == 2


def test_a_retry_after_an_abort_runs_anew_while_the_aborting_handler_still_unwinds(
        callee: Callee) -> None:
    key = new_key()
    if callee.kind == "sync":  # the control case: its status is sent once the handler unwound
        callee.work.unwound.set()
    try:  # a's handler is still unwinding when b comes (aio: a's status was sent at its abort)
        a, b = (plain(callee.url, "FailSlowly", key=key) for _ in range(2))
    finally:
        callee.work.unwound.set()
    assert a.code == b.code == Code.UNAVAILABLE and b.joined is None  # b ran: it joined nothing
    assert callee.work.runs["FailSlowly", key] == 2


def test_the_waiters_of_a_give_up_get_its_unavailable_and_its_do_not_retry(
        callee: Callee) -> None:
    key, n = new_key(), 3
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        got = list(pool.map(lambda _: plain(callee.url, "GiveUp", key=key), range(n)))
    waited = [a for a in got if a.joined == "wait"]
    assert waited, "the calls overlapped the run"
    assert callee.work.runs["GiveUp", key] == n - len(waited)
    for a in got:
        assert a.code == Code.UNAVAILABLE
        assert (a.reply.dnr, a.reply.reason, a.reply.joins) == (True, "exhausted", True)


def test_another_request_under_the_same_key_is_refused(callee: Callee) -> None:
    key = new_key()
    first = plain(callee.url, "Quick", b"pay 10", key=key)
    other = plain(callee.url, "Quick", b"pay 1000", key=key)
    assert first.code == Code.OK and other.code == Code.FAILED_PRECONDITION
    assert other.details == "this question's key came with another request"
    assert callee.work.runs["Quick", key] == 1
    # The other method is another operation: the key is not taken there.
    assert plain(callee.url, "Missing", b"pay 1000", key=key).joined is None


def test_a_reattach_with_no_run_to_join_is_refused_never_run(callee: Callee) -> None:
    before = askonce.stats()
    refused = plain(callee.url, "Quick", key=new_key(), rejoin=True)
    assert refused.code == Code.UNAVAILABLE
    assert refused.details == "askonce: no run of this question to join here"
    assert refused.reply == Reply(0, True, "exhausted", joins=True)
    assert sum(callee.work.runs.values()) == 0 and callee.arrivals("Quick") == 1
    assert delta(before).get("server.join.refused-rejoin") == 1


def test_answers_too_large_are_not_kept_and_minted_questions_never_joined() -> None:
    c = Callee("sync", policy=JoinPolicy(max_body=1024))
    try:
        key, before = new_key(), askonce.stats()
        big = [plain(c.url, "Big", key=key) for _ in range(2)]
        unkeyed = [plain(c.url, "Quick") for _ in range(2)]  # this layer mints: nothing to join
    finally:
        c.close()
    assert [a.body for a in big] == [b"x" * 2048] * 2 and c.work.runs["Big", key] == 2
    assert delta(before).get("server.join.too-large") == 2
    assert [a.code for a in unkeyed] == [Code.OK] * 2 and c.work.runs["Quick", "-"] == 0
    assert sum(n for (m, _), n in c.work.runs.items() if m == "Quick") == 2


@pytest.mark.parametrize("kind", ["sync", "aio"])
def test_another_principals_question_is_never_replayed(kind: str) -> None:
    def user(ctx: Any) -> str:
        return str(dict(ctx.invocation_metadata()).get("x-user", ""))

    c = Callee(kind, principal=user)
    try:
        key = new_key()
        got = {who: plain(c.url, "Quick", key=key, metadata=(("x-user", who),))
               for who in ("alice", "bob")}
        again = plain(c.url, "Quick", key=key, metadata=(("x-user", "alice"),))
    finally:
        c.close()
    assert c.work.runs["Quick", key] == 2  # one run per principal
    assert [a.joined for a in got.values()] == [None, None]
    assert again.joined in ("wait", "replay")  # alice's own answer, joined (not run again)


@pytest.mark.parametrize("kind", ["sync", "aio"])
def test_a_flood_of_distinct_keys_keeps_the_table_bounded(kind: str) -> None:
    c = Callee(kind, policy=JoinPolicy(max_entries=20))
    try:
        codes = [plain(c.url, "Quick", key=new_key()).code for _ in range(100)]
        size = len(c.join.joins)
    finally:
        c.close()
    assert codes == [Code.OK] * 100 and size <= 20
    assert sum(c.work.runs.values()) == 100


def test_the_join_interceptor_outside_the_askonce_one_passes_calls_through() -> None:
    work, servers = Work(), ServerSet()
    try:
        _, url = servers.add_sync(sync_service(work), interceptors=[
            JoinServerInterceptor(), AskonceServerInterceptor(layer="target")])
        key, before = new_key(), askonce.stats()
        got = [plain(url, "Quick", key=key) for _ in range(2)]
    finally:
        servers.close()
    assert [a.body for a in got] == [b"answer to q"] * 2 and work.runs["Quick", key] == 2
    assert delta(before).get("server.join.unbound") == 2


# --- an askonce client toward a joining callee ------------------------------------------------------


def _left() -> int:
    q = askonce.current()
    assert q is not None
    return q.budget


def _client_call(kind: str, url: str, name: str, policy: ClientPolicy,
                 timeout: float | None) -> tuple[bytes, dict[str, Any], int]:
    """Calls ``name`` once under a question of budget 4 (after a warm call, under a policy of no
    attempt timeout, that learns the callee joins; the channel connected first): the answer, its
    trailing metadata, and the budget the question has left."""
    warm = ClientPolicy(layer="svc", bucket=None)
    if kind == "sync":
        with grpc.insecure_channel(url, options=channel_options()) as raw:
            grpc.channel_ready_future(raw).result(timeout=10.0)
            learn = grpc.intercept_channel(raw, AskonceClientInterceptor(warm, target=url))
            with askonce.question(budget=4, deadline=10.0):
                learn.unary_unary(method("Quick"))(b"warm", timeout=10.0)
            channel = grpc.intercept_channel(
                raw, AskonceClientInterceptor(policy, target=url, idempotent=False))
            with askonce.question(budget=4, deadline=10.0):
                body, call = channel.unary_unary(method(name)).with_call(b"q", timeout=timeout)
                return body, dict(call.trailing_metadata()), _left()

    async def go() -> tuple[bytes, dict[str, Any], int]:
        learning = [AsyncAskonceClientInterceptor(warm, target=url)]
        async with aio.insecure_channel(url, options=channel_options(),
                                        interceptors=learning) as learn, \
                askonce.question(budget=4, deadline=10.0):
            await learn.unary_unary(method("Quick"))(b"warm", timeout=10.0)
        interceptor = AsyncAskonceClientInterceptor(policy, target=url, idempotent=False)
        async with aio.insecure_channel(url, options=channel_options(),
                                        interceptors=[interceptor]) as channel:
            await asyncio.wait_for(channel.channel_ready(), 10.0)
            async with askonce.question(budget=4, deadline=10.0):
                call = channel.unary_unary(method(name))(b"q", timeout=timeout)
                body = await call
                return body, dict(await call.trailing_metadata()), _left()

    return asyncio.run(go())


@pytest.mark.parametrize("client", ["sync", "aio"])
def test_a_try_timed_out_by_grpc_reattaches_to_the_run_and_gets_its_answer(
        callee: Callee, client: str) -> None:
    """The per-attempt gRPC timeout is shorter than the handler: each timed-out try is retried
    as a re-attach (paid from the budget), the run goes on (aio: detached from its caller), and
    the handler runs once."""
    policy = ClientPolicy(layer="svc", bucket=None, retry=askonce.RetryPolicy(attempts=5))
    body, trailing, left = _client_call(client, callee.url, "Slow", policy, TIMEOUT)
    assert body == b"answer to q" and trailing[JOINED] in ("wait", "replay")
    reply = parse_reply(trailing[REPLY_HEADER])
    assert isinstance(reply, Reply) and reply.joins
    (key,) = [k for (m, k) in callee.work.runs if m == "Slow"]
    assert callee.work.runs["Slow", key] == 1  # the work was done once
    seen = callee.arrivals("Slow")
    assert 2 <= seen <= 1 + 4  # each re-attach is an arrival, paid from the budget
    assert left == 4 - (seen - 1)


@pytest.mark.parametrize("client", ["sync", "aio"])
def test_a_try_timed_out_by_grpc_is_no_word_that_the_callee_stopped_joining(
        callee: Callee, client: str) -> None:
    """gRPC's own DEADLINE_EXCEEDED carries no reply of the callee: the client goes on knowing
    that it joins (had it forgotten, its next calls would be capped at ``attempt_timeout``)."""
    from askonce.client import JOINERS

    policy = ClientPolicy(layer="svc", bucket=None)
    if client == "sync":
        with grpc.insecure_channel(callee.url, options=channel_options()) as raw:
            channel = grpc.intercept_channel(raw, AskonceClientInterceptor(policy,
                                                                           target=callee.url))
            with askonce.question(budget=4, deadline=10.0):
                channel.unary_unary(method("Quick"))(b"warm", timeout=10.0)
            assert callee.url in JOINERS
            with askonce.question(budget=0, deadline=10.0), pytest.raises(grpc.RpcError) as lost:
                channel.unary_unary(method("Slow"))(b"q", timeout=TIMEOUT)
        code = lost.value.code()
    else:
        async def go() -> grpc.StatusCode:
            interceptor = AsyncAskonceClientInterceptor(policy, target=callee.url)
            async with aio.insecure_channel(callee.url, options=channel_options(),
                                            interceptors=[interceptor]) as channel:
                async with askonce.question(budget=4, deadline=10.0):
                    await channel.unary_unary(method("Quick"))(b"warm", timeout=10.0)
                assert callee.url in JOINERS
                try:
                    async with askonce.question(budget=0, deadline=10.0):
                        await channel.unary_unary(method("Slow"))(b"q", timeout=TIMEOUT)
                except grpc.RpcError as error:
                    return error.code()
                raise AssertionError("the slow call answered within its timeout")

        code = asyncio.run(go())
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert callee.url in JOINERS


@pytest.mark.parametrize("client", ["sync", "aio"])
def test_the_policys_attempt_timeout_gives_way_to_waiting_for_a_joining_callee(
        callee: Callee, client: str) -> None:
    policy = ClientPolicy(layer="svc", bucket=None, attempt_timeout=TIMEOUT,
                          retry=askonce.RetryPolicy(attempts=5))
    body, trailing, left = _client_call(client, callee.url, "Slow", policy, None)
    assert body == b"answer to q" and JOINED not in trailing
    assert callee.arrivals("Slow") == 1 and left == 4


def test_an_aio_run_goes_on_after_its_caller_left_within_the_questions_deadline() -> None:
    c = Callee("aio")
    try:
        key = new_key()
        gone = plain(c.url, "Slow", key=key, timeout=0.2)  # the caller leaves before the answer
        deadline = time.monotonic() + 10.0
        while c.join._background and time.monotonic() < deadline:
            time.sleep(0.05)  # until the run, in a task of its own, is done
        later = plain(c.url, "Slow", key=key)
    finally:
        c.close()
    assert gone.code == Code.DEADLINE_EXCEEDED
    assert later.code == Code.OK and later.body == b"answer to q"
    assert later.joined == "replay" and c.work.runs["Slow", key] == 1


def test_waiters_whose_calls_end_first_leave_nothing_behind_and_never_answer_for_their_deadline(
        ) -> None:
    """A sync waiter's wait ends with its call: it holds no thread or event past it, and it does
    not answer for its own gRPC deadline (the caller's library does: a lost try, re-attached)."""
    c = Callee("sync")
    try:
        key = new_key()
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            first = pool.submit(plain, c.url, "Slow", key=key)
            deadline = time.monotonic() + 10.0
            while c.work.runs["Slow", key] == 0 and time.monotonic() < deadline:
                time.sleep(0.02)  # until the run is in flight
            gone = list(pool.map(lambda _: plain(c.url, "Slow", key=key, timeout=0.1), range(5)))
            entry = c.join.joins.peek(("", method("Slow"), key), time.monotonic())
            assert entry is not None and isinstance(entry.signal, Run)
            wake = entry.signal.wake
            while wake._events and not entry.done and time.monotonic() < deadline:
                time.sleep(0.01)  # the server hears of a call's end just after its caller
            # Gone while the run is still in flight (not cleared by the run's end).
            left_behind, in_flight = len(wake._events), not entry.done
            answered = first.result(timeout=10.0)
    finally:
        c.close()
    assert [a.code for a in gone] == [Code.DEADLINE_EXCEEDED] * 5
    assert all(REPLY_HEADER not in a.trailing for a in gone)  # made by the client's gRPC
    assert (left_behind, in_flight) == (0, True)
    assert answered.code == Code.OK and c.work.runs["Slow", key] == 1
