"""askonce.integrations.httpx: sync and async transports against a real server on 127.0.0.1."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

import askonce
from askonce import Backoff, Reply, RetryPolicy
from askonce.client import ClientPolicy, last_reply, replies
from askonce.core.backoff import NO_WAIT
from askonce.core.breaker import BreakerPolicy
from askonce.core.question import Hop
from askonce.core.wire import parse_dictionary
from askonce.integrations.httpx import AskonceTransport, AsyncAskonceTransport, default_target
from askonce.stores.memory import MemoryStore
from http_target import Target, policy, refused_url

MODES = ["sync", "async"]


def send(mode: str, p: ClientPolicy, method: str, url: str, *, sleep: Any = None, timeout: float = 5.0,
         limits: httpx.Limits | None = None, **kw: Any) -> httpx.Response:
    """One request through a fresh client with the askonce transport (its own event loop when async)."""
    pool = {} if limits is None else {"limits": limits}
    if mode == "sync":
        transport = AskonceTransport(httpx.HTTPTransport(**pool), policy=p, sleep=sleep)
        with httpx.Client(transport=transport, timeout=timeout) as client:
            return client.request(method, url, **kw)

    async def go() -> httpx.Response:
        transport = AsyncAskonceTransport(httpx.AsyncHTTPTransport(**pool), policy=p, sleep=sleep)
        async with httpx.AsyncClient(transport=transport, timeout=timeout) as client:
            return await client.request(method, url, **kw)

    return asyncio.run(go())


@pytest.mark.parametrize("mode", MODES)
def test_a_failing_target_sees_at_most_one_plus_budget_arrivals_per_question(mode: str, target: Target) -> None:
    p = policy(retry=RetryPolicy(attempts=10, backoff=NO_WAIT))
    keys = []
    for _ in range(5):
        with askonce.question(budget=2) as q:
            response = send(mode, p, "GET", target.url("/fail"))
        keys.append(q.key)
        assert response.status_code == 503
        assert response.askonce_reply == Reply(0, True, "exhausted")  # type: ignore[attr-defined]
    assert [target.arrivals[k] for k in keys] == [3] * 5
    assert set(target.arrivals) == set(keys)  # no attempt went out under another key


@pytest.mark.parametrize("mode", MODES)
def test_the_key_is_forwarded_unchanged_and_the_path_shows_layer_and_attempt(mode: str, target: Target) -> None:
    with askonce.question(budget=2) as q, askonce.propagation.bind(askonce.current(), path=(Hop("api", 2),)):  # type: ignore[arg-type]
        response = send(mode, policy(), "GET", target.url("/fail/2"))
    assert response.status_code == 200
    assert [s.key for s in target.seen if s] == [q.key] * 3
    assert [tuple(map(str, s.path)) for s in target.seen if s] == [
        ("api:2", "web:1"), ("api:2", "web:2"), ("api:2", "web:3")]
    assert [s.budget for s in target.seen if s] == [2, 1, 0]  # each retry spent one of the question's budget


@pytest.mark.parametrize("mode", MODES)
def test_failed_attempts_release_their_connection(mode: str, target: Target) -> None:
    one = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    with askonce.question(budget=2):
        response = send(mode, policy(), "GET", target.url("/fail/2"), limits=one, timeout=2.0)
    assert response.status_code == 200 and response.text == "ok"
    assert len(set(target.ports)) == 1  # the failed attempts' bodies were read: one keep-alive connection


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("path", "arrivals", "waits"), [("/after/1", 2, [1.0]), ("/t429", 2, [1.0]),
                                                          ("/after/4", 1, [])])
def test_retry_after_is_honoured_up_to_max_pushback(mode: str, path: str, arrivals: int, waits: list[float],
                                                    target: Target) -> None:
    slept: list[float] = []
    p = policy(retry=RetryPolicy(attempts=3, backoff=NO_WAIT, max_pushback=2.0))
    with askonce.question(budget=2):
        response = send(mode, p, "GET", target.url(path), sleep=slept.append)
    assert slept == waits and target.total == arrivals
    if not waits:  # asked to wait longer than this layer will: give up and say so
        assert response.status_code == 503
        # and passes the wait upward as its own max_pushback: never more than it would wait itself
        assert response.askonce_reply == Reply(2, True, "overloaded", 2.0)  # type: ignore[attr-defined]


def test_429_without_retry_after_is_not_retried(target: Target) -> None:
    with askonce.question(budget=2):
        response = send("sync", policy(), "GET", target.url("/status/429"))
    assert response.status_code == 429 and target.total == 1


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("method", "kw", "arrivals"),
    [
        ("POST", {}, 1),
        ("PATCH", {}, 1),
        ("POST", {"headers": {"Idempotency-Key": "order-7"}}, 3),
        ("POST", {"extensions": {"askonce.idempotent": True}}, 3),
        ("GET", {"extensions": {"askonce.idempotent": False}}, 1),
        ("PUT", {}, 3),
    ],
)
def test_non_idempotent_requests_are_not_retried_unless_told(mode: str, method: str, kw: dict[str, Any],
                                                             arrivals: int, target: Target) -> None:
    with askonce.question(budget=2):
        response = send(mode, policy(), method, target.url("/fail"), content=b"{}", **kw)
    assert response.status_code == 503 and target.total == arrivals


def test_a_body_that_cannot_be_replayed_is_sent_once(target: Target) -> None:
    def body() -> Iterator[bytes]:
        yield b"chunk"

    with askonce.question(budget=2):
        response = send("sync", policy(), "POST", target.url("/fail"), content=body(),
                        headers={"Idempotency-Key": "k"})
    assert response.status_code == 503 and target.total == 1


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("method", ["GET", "POST"])
def test_refused_connections_are_retried_without_spending_the_callees_budget(mode: str, method: str) -> None:
    slept: list[float] = []
    p = policy(retry=RetryPolicy(attempts=3, backoff=Backoff(base=0.001, cap=0.001, jitter=False)))
    with askonce.question(budget=5), pytest.raises(httpx.ConnectError) as info:
        send(mode, p, method, refused_url(), sleep=slept.append)
    assert slept == [0.001, 0.001]  # even a POST: it never left
    # 5 - our 2 retries; this layer retried: nobody above should (one_layer)
    assert info.value.askonce_reply == Reply(3, True, "retried")  # type: ignore[attr-defined]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("path", "cause"), [("/slow", httpx.ReadTimeout), ("/close", httpx.RemoteProtocolError)])
def test_sent_and_lost_fails_closed(mode: str, path: str, cause: type[Exception], target: Target) -> None:
    with askonce.question(budget=2), pytest.raises(askonce.BudgetExhausted) as info:
        send(mode, policy(), "GET", target.url(path), timeout=0.2)
    assert isinstance(info.value.__cause__, cause)
    assert target.total == 1  # the callee may have spent all it was given: no budget left to retry with
    assert info.value.askonce_reply == Reply(0, True, "exhausted")


@pytest.mark.parametrize("mode", MODES)
def test_do_not_retry_from_the_server_stops_retries_and_is_passed_on(mode: str, target: Target) -> None:
    with askonce.question(budget=2), replies():
        response = send(mode, policy(), "GET", target.url("/dnr"))
        passed_on = last_reply()
    assert response.status_code == 503 and target.total == 1
    assert response.askonce_reply.dnr and response.askonce_reply.reason == "overloaded"  # type: ignore[attr-defined]
    assert passed_on == response.askonce_reply  # type: ignore[attr-defined]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("question", "attempt_timeout"), [({"deadline": 1.0}, None), ({}, 1.0)])
def test_each_attempt_is_bounded_by_the_deadline_and_attempt_timeout(mode: str, question: dict[str, Any],
                                                                     attempt_timeout: float | None,
                                                                     target: Target) -> None:
    with askonce.question(budget=2, **question), pytest.raises(askonce.GaveUp) as info:
        send(mode, policy(attempt_timeout=attempt_timeout), "GET", target.url("/slow"), timeout=5.0)
    # the try timed out (httpx's read timeout), or, on a loaded machine, the question's own
    # deadline ended it first: either way not the 5 s of the client's own timeout
    assert isinstance(info.value.__cause__, httpx.ReadTimeout) or (
        "deadline" in question and isinstance(info.value, askonce.DeadlineExceeded))
    announced = parse_dictionary(target.raw[0] or "")
    assert isinstance(announced, dict) and 0 < int(announced["d"]) <= 1000  # type: ignore[arg-type]


def test_a_flaky_target_is_answered_for_every_question(target: Target) -> None:
    p = policy()
    with httpx.Client(transport=AskonceTransport(policy=p)) as client:
        statuses = []
        for _ in range(40):
            with askonce.question(budget=2):
                statuses.append(client.get(target.url("/flaky")).status_code)
    assert statuses == [200] * 40
    assert max(target.arrivals.values()) <= 3 and target.total < 40 * 1.3


def test_without_a_bound_question_each_request_is_a_question_of_its_own(target: Target) -> None:
    with httpx.Client(transport=AskonceTransport(policy=policy())) as client:
        client.get(target.url("/ok"))
        client.get(target.url("/ok"))
    a, b = target.seen
    assert a is not None and b is not None and a.key != b.key and (a.origin, a.edge) == ("web", False)


def test_default_target_is_the_origin() -> None:
    assert default_target(httpx.Request("GET", "http://svc/x")) == "http://svc:80"
    assert default_target(httpx.Request("GET", "https://svc:8443/x")) == "https://svc:8443"


def test_wrapping_something_else_is_refused() -> None:
    with pytest.raises(ValueError):
        AskonceTransport(httpx.AsyncHTTPTransport())  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        AsyncAskonceTransport(httpx.HTTPTransport())  # type: ignore[arg-type]


MISCONFIGURED: list[Any] = [
    pytest.param(lambda: AskonceTransport(target="http://billing"), id="httpx target not callable"),  # type: ignore[arg-type]
    pytest.param(lambda: AsyncAskonceTransport(target="x"), id="async httpx target not callable"),  # type: ignore[arg-type]
    pytest.param(lambda: AskonceTransport(clock=5), id="clock not callable"),
]


@pytest.mark.parametrize("make", MISCONFIGURED)
def test_a_misconfiguration_is_refused_at_construction(make: Callable[[], object]) -> None:
    with pytest.raises(ValueError):
        make()


class AsyncBuckets:
    """A store whose bucket handles are async, as a store shared over the network would have them."""

    def __init__(self) -> None:
        self.inner = MemoryStore(lambda: 0.0)
        self.withdrawals = 0

    def bucket(self, target: str, policy: askonce.BucketPolicy) -> Any:
        handle, owner = self.inner.bucket(target, policy), self

        class Handle:
            def deposit(self) -> None:
                handle.deposit()

            async def withdraw(self, now: float) -> bool:
                owner.withdrawals += 1
                return handle.withdraw(now)

        return Handle()


def test_the_async_transport_awaits_async_store_handles(target: Target) -> None:
    store = AsyncBuckets()
    p = policy(bucket=askonce.BucketPolicy(ratio=0.0, floor=1.0, max_tokens=0))

    async def go() -> httpx.Response:
        transport = AsyncAskonceTransport(policy=p, store=store, clock=lambda: 0.0)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport) as client:
            return await client.get(target.url("/fail"))

    with askonce.question(budget=5):
        response = asyncio.run(go())
    assert response.status_code == 503 and target.total == 2  # one floor token, then throttled
    assert store.withdrawals == 2
    assert response.askonce_reply.reason == "throttled"  # type: ignore[attr-defined]


def test_the_sync_transport_refuses_async_store_handles(target: Target) -> None:
    p = policy(bucket=askonce.BucketPolicy())
    transport = AskonceTransport(policy=p, store=AsyncBuckets())  # type: ignore[arg-type]
    with httpx.Client(transport=transport) as client, askonce.question(budget=2), pytest.raises(TypeError):
        client.get(target.url("/fail"))


@pytest.mark.parametrize("mode", MODES)
def test_an_open_breaker_answers_for_the_target(mode: str, target: Target) -> None:
    p = policy(breaker=BreakerPolicy(window_size=2, minimum_calls=2, failure_rate=0.5, open_for=30.0))
    store, now = MemoryStore(lambda: 0.0), [0.0]

    def request() -> httpx.Response:
        if mode == "sync":
            with httpx.Client(transport=AskonceTransport(policy=p, store=store, clock=lambda: now[0])) as c:
                return c.get(target.url("/fail"))

        async def go() -> httpx.Response:
            transport = AsyncAskonceTransport(policy=p, store=store, clock=lambda: now[0])
            async with httpx.AsyncClient(transport=transport) as c:
                return await c.get(target.url("/fail"))

        return asyncio.run(go())

    with askonce.question(budget=1):
        assert request().status_code == 503  # two failures: the breaker opens
    now[0] = 1.0
    with askonce.question(budget=1), pytest.raises(askonce.CircuitOpen) as info:
        request()
    assert target.total == 2 and info.value.retry_at == 30.0


@pytest.mark.parametrize("mode", MODES)
def test_a_breaker_opened_by_the_questions_own_failure_raises_instead_of_returning_a_released_response(
        mode: str, target: Target) -> None:
    # The first attempt's 503 is discarded (read, closed) before the retry, which the breaker it
    # just opened refuses: that give-up has no response left to return. It used to return the
    # released one, and httpx raised StreamConsumed reading it.
    p = policy(retry=RetryPolicy(attempts=3, backoff=NO_WAIT),
               breaker=BreakerPolicy(window_size=2, minimum_calls=1, failure_rate=0.5))
    store = MemoryStore(lambda: 0.0)

    def request() -> httpx.Response:
        if mode == "sync":
            with httpx.Client(transport=AskonceTransport(policy=p, store=store, clock=lambda: 0.0)) as c:
                return c.get(target.url("/fail"))

        async def go() -> httpx.Response:
            transport = AsyncAskonceTransport(policy=p, store=store, clock=lambda: 0.0)
            async with httpx.AsyncClient(transport=transport) as c:
                return await c.get(target.url("/fail"))

        return asyncio.run(go())

    with pytest.raises(askonce.CircuitOpen) as info:
        request()
    assert info.value.reason == "breaker-open" and target.total == 1


def test_the_per_target_key_is_configurable(target: Target) -> None:
    keys: list[str] = []

    class Recording(MemoryStore):
        def bucket(self, name: str, p: askonce.BucketPolicy) -> Any:
            keys.append(name)
            return super().bucket(name, p)

    transport = AskonceTransport(policy=policy(bucket=askonce.BucketPolicy()), store=Recording(lambda: 0.0),
                                 target=lambda request: "billing")
    with httpx.Client(transport=transport) as client:
        client.get(target.url("/ok"))
    assert keys == ["billing"]


def test_timeouts_go_out_as_they_came_until_the_question_has_less_time_left(target: Target) -> None:
    sent: list[dict[str, float]] = []

    class Recording(httpx.HTTPTransport):
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            sent.append(dict(request.extensions["timeout"]))
            return super().handle_request(request)

    with askonce.question(budget=2, deadline=6.0) as q:
        now = [q.deadline - 6.0]  # type: ignore[operator]  # the question's own clock, driven by the test

        def sleep(seconds: float) -> None:
            now[0] += 3.0  # the retry starts 3 s later

        p = policy(retry=RetryPolicy(attempts=3, backoff=Backoff(base=0.001, cap=0.001)))
        transport = AskonceTransport(Recording(), policy=p, clock=lambda: now[0], sleep=sleep)
        with httpx.Client(transport=transport, timeout=5.0) as client:
            assert client.get(target.url("/fail/1")).status_code == 200
    assert sent == [{"connect": 5.0, "read": 5.0, "write": 5.0, "pool": 5.0},  # 6 s left: the client's own
                    {"connect": 3.0, "read": 3.0, "write": 3.0, "pool": 3.0}]  # 3 s left: capped


def test_the_target_is_not_computed_when_no_bucket_breaker_or_rejoin_needs_it(target: Target) -> None:
    def target_of(request: httpx.Request) -> str:
        raise AssertionError("not needed without a bucket, a breaker or rejoining")

    transport = AskonceTransport(policy=policy(bucket=None, breaker=None, rejoin=False), target=target_of)
    with httpx.Client(transport=transport) as client:
        assert client.get(target.url("/fail/1")).status_code == 200  # a retry too: still not needed
