"""The defects the integrations audit found outside the integrations, fixed where they lived.

``test_audit_config`` and ``test_audit_wsgi_bounds`` drive them through the integrations; these pin each
fix at its own function: ``wire.to_ms`` / ``format_question`` / ``format_reply`` clamp what they round,
``Server.failure`` answers any pushback within the protocol and counts only known reasons by name, a
call whose header cannot be built gives back what it held, and the shared policies refuse at construction
what they would otherwise misread.
"""

from __future__ import annotations

import enum
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import askonce
from askonce import Limits, Reply, RetryPolicy, context
from askonce.client import Caller, ClientPolicy, Outcome
from askonce.core import wire
from askonce.core.breaker import BreakerPolicy
from askonce.core.question import Account, Tab
from askonce.integrations._server import Server, ServerOptions
from askonce.stores.memory import MemoryStore

KEY = "0123456789abcdefABCDEF"

# --- the wire clamps before it rounds ---------------------------------------------------------------------


@pytest.mark.parametrize(("seconds", "ms"), [
    (math.inf, wire.MAX_DEADLINE_MS), (-math.inf, 0), (math.nan, 0), (1e12, wire.MAX_DEADLINE_MS),
    (86_400.0000001, wire.MAX_DEADLINE_MS), (-0.5, 0), (0.0, 0), (2.5, 2500), (1.001, 1001),
])
def test_to_ms_clamps_into_the_protocol_range_and_never_raises(seconds: float, ms: int) -> None:
    assert wire.to_ms(seconds, up=True) == ms
    assert wire.to_ms(seconds, up=False) == ms


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_format_question_writes_the_deadline_to_ms_would(remaining: float) -> None:
    text = wire.format_question(KEY, "api", False, 2, remaining)
    assert text.endswith(f", d={wire.to_ms(remaining, up=False)}")
    q = wire.parse_question(text, 0.0, Limits(max_deadline=86_400))
    assert isinstance(q, askonce.Question)  # whatever was asked, the header parses


@pytest.mark.parametrize("pushback", [math.inf, math.nan, 1e12, -3.0])
def test_format_reply_writes_any_pushback_within_a_day(pushback: float) -> None:
    reply = wire.parse_reply(wire.format_reply(Reply(0, True, "overloaded", pushback)))
    assert isinstance(reply, Reply) and reply.pushback is not None
    assert 0 <= reply.pushback <= wire.MAX_DEADLINE_MS / 1000


# --- Server.failure ---------------------------------------------------------------------------------------


def _fail(reply: Reply) -> Any:
    server = Server(ServerOptions(layer="svc"))
    arrival = server.open([], None, lambda request: "op")
    try:
        exc = askonce.DoNotRetry("busy", reply=reply, layer="svc", key=None, attempts=1)
        return server.failure(arrival, exc)
    finally:
        server.close(arrival)


@pytest.mark.parametrize(("pushback", "retry_after"), [
    (math.inf, 86_400), (math.nan, 0), (1e12, 86_400), (-1.0, 0), (2.5, 3), (1.001, 2), (3.0, 3),
])
def test_a_give_ups_retry_after_agrees_with_its_reply(pushback: float, retry_after: int) -> None:
    answer = _fail(Reply(0, True, "overloaded", pushback))
    assert answer.status == 503 and answer.retry_after == retry_after
    sent = wire.parse_reply(dict(answer.headers())[wire.REPLY_HEADER])
    assert isinstance(sent, Reply) and sent.pushback is not None
    assert math.ceil(sent.pushback) == retry_after  # the header and Retry-After say the same
    assert answer.reply.pushback == sent.pushback  # and so does the reply the integrations read


def test_a_give_up_is_counted_by_its_reason_only_when_the_reason_is_known() -> None:
    before = askonce.stats()
    for reason in ("overloaded", "made-up", "made-up-too", None):
        _fail(Reply(0, True, reason))
    after = askonce.stats()
    grown = {k: after[k] - before.get(k, 0) for k in after if k.startswith("server.gave-up.")
             and after[k] != before.get(k, 0)}
    assert grown == {"server.gave-up.overloaded": 1, "server.gave-up.other": 3}


# --- a header that cannot be built holds nothing ----------------------------------------------------------


class Unsent:
    """An exchange that must never be reached: the header fails first."""

    timeout = None

    def send(self, header: str, timeout: float | None) -> object:
        raise AssertionError("sent")

    def judge(self, response: object) -> Outcome:
        raise AssertionError("judged")

    def judge_error(self, error: Exception) -> Outcome | None:
        raise AssertionError("judged")

    def discard(self, response: object) -> None:
        pass


PROBING = BreakerPolicy(open_for=1.0, half_open_probes=1)


def _minter() -> str:
    raise RuntimeError("no key today")


@pytest.mark.parametrize("policy", [
    pytest.param(ClientPolicy(bucket=None), id="first attempt (fast path)"),
    pytest.param(ClientPolicy(bucket=None, breaker=PROBING), id="general loop (breaker)"),
])
def test_a_call_whose_header_cannot_be_built_gives_back_what_it_held(policy: ClientPolicy) -> None:
    account = Account(3)
    store = MemoryStore(lambda: 0.0)
    if policy.breaker is not None:  # half-open with one probe slot: a slot not given back refuses the next call
        store.breaker("t", policy.breaker).force_open(0.0)
    caller = Caller(policy, store=store, clock=lambda: 2.0)
    # bound as a server binds it (context.bind would mint the key at once)
    token = context._frame.set((Tab(None, "api", False, account, None, minter=_minter), ()))
    try:
        for _ in range(2):
            with pytest.raises(RuntimeError, match="no key today"):
                caller.call(Unsent(), target="t")
            if policy.breaker is not None:  # the probe's slot was handed back: the next call may probe again
                assert store.breaker("t", policy.breaker).snapshot()["probes_admitted"] == 0
    finally:
        context._frame.reset(token)
    assert account.left == 3


# --- the shared policies refuse at construction what they would misread ------------------------------------


REFUSED: list[Any] = [
    pytest.param(lambda: Caller(clock=5), id="clock"),  # type: ignore[arg-type]
    pytest.param(lambda: Caller(sleep="soon"), id="sleep"),  # type: ignore[arg-type]
    pytest.param(lambda: Caller(random=0.5), id="random"),  # type: ignore[arg-type]
    pytest.param(lambda: Caller(store=object()), id="store"),  # type: ignore[arg-type]
    pytest.param(lambda: ClientPolicy(throttle_statuses="429"), id="throttle_statuses str"),  # type: ignore[arg-type]
    pytest.param(lambda: ClientPolicy(retry_statuses=[503, "504"]), id="retry_statuses holds a str"),  # type: ignore[arg-type]
    pytest.param(lambda: ClientPolicy(idempotent_methods=["GET", 1]), id="idempotent_methods holds an int"),  # type: ignore[arg-type]
    pytest.param(lambda: ClientPolicy(idempotent_methods=[["GET"]]), id="idempotent_methods unhashable"),  # type: ignore[arg-type]
    pytest.param(lambda: ClientPolicy(idempotency_header=b"Idempotency-Key"), id="idempotency_header bytes"),  # type: ignore[arg-type]
    pytest.param(lambda: ClientPolicy(attempt_timeout=math.nan), id="attempt_timeout nan"),
    pytest.param(lambda: ClientPolicy(retry_non_idempotent=1), id="retry_non_idempotent int"),  # type: ignore[arg-type]
    pytest.param(lambda: Limits(max_deadline=True), id="Limits max_deadline bool"),
    pytest.param(lambda: Limits(max_deadline=math.nan), id="Limits max_deadline nan"),
    pytest.param(lambda: Limits(max_budget=None), id="Limits max_budget None"),  # type: ignore[arg-type]
    pytest.param(lambda: RetryPolicy(attempts=True), id="RetryPolicy attempts bool"),
    pytest.param(lambda: RetryPolicy(budget="2"), id="RetryPolicy budget str"),  # type: ignore[arg-type]
    pytest.param(lambda: RetryPolicy(idempotent="no"), id="RetryPolicy idempotent str"),  # type: ignore[arg-type]
    pytest.param(lambda: RetryPolicy(backoff=None), id="RetryPolicy backoff None"),  # type: ignore[arg-type]
    pytest.param(lambda: RetryPolicy(deadline=True), id="RetryPolicy deadline bool"),
    pytest.param(lambda: RetryPolicy(min_attempt="1"), id="RetryPolicy min_attempt str"),  # type: ignore[arg-type]
    pytest.param(lambda: RetryPolicy(max_pushback=math.nan), id="RetryPolicy max_pushback nan"),
]


@pytest.mark.parametrize("make", REFUSED)
def test_a_misconfiguration_is_a_value_error_naming_the_value(make: Any) -> None:
    with pytest.raises(ValueError, match=r"got|not a single"):
        make()


def test_what_was_accepted_before_still_is() -> None:
    p = ClientPolicy(retry_statuses=[503], idempotent_methods=("get", "put"),  # type: ignore[arg-type]
                     attempt_timeout=2, idempotency_header=None, originator=True)
    assert p.retry_statuses == frozenset({503}) and p.idempotent_methods == frozenset({"GET", "PUT"})
    assert Limits(max_budget=0, max_deadline=5).max_deadline == 5
    assert RetryPolicy(attempts=1, budget=0, deadline=None, max_pushback=0).attempts == 1

    class BucketsOnly:  # a store without breakers still serves a policy without a breaker
        def bucket(self, target: str, policy: Any) -> Any:
            return MemoryStore(lambda: 0.0).bucket(target, policy)

    store: Any = BucketsOnly()
    Caller(ClientPolicy(), store=store, clock=lambda: 0.0, sleep=lambda s: None, random=lambda: 0.5)

    class BreakersOnly:  # and one without buckets a policy without a bucket
        def breaker(self, target: str, policy: Any) -> Any:
            return MemoryStore(lambda: 0.0).breaker(target, policy)

    store = BreakersOnly()
    Caller(ClientPolicy(bucket=None, breaker=BreakerPolicy()), store=store)
    with pytest.raises(ValueError, match="bucket"):
        Caller(ClientPolicy(breaker=BreakerPolicy()), store=store)

    class Tries(enum.IntEnum):  # integers read from configuration as an IntEnum are integers
        THREE = 3

    assert RetryPolicy(attempts=Tries.THREE, budget=Tries.THREE).attempts == 3
    assert Limits(max_budget=Tries.THREE).max_budget == 3


@pytest.mark.parametrize("bad", ["timeout", "minter"])
def test_outgoing_gives_back_what_it_held_when_the_header_cannot_be_built(bad: str) -> None:
    account = Account(3)
    tab = Tab(None, "api", False, account, None, minter=_minter) if bad == "minter" else Tab(
        "k" * 26, "api", False, account, None)
    token = context._frame.set((tab, ()))
    try:
        with pytest.raises((RuntimeError, TypeError)):
            context.outgoing({}, timeout="5" if bad == "timeout" else None)  # type: ignore[arg-type]
    finally:
        context._frame.reset(token)
    assert account.left == 3


async def test_an_asgi_give_up_after_the_response_started_is_not_counted_as_a_503() -> None:
    from askonce.integrations.asgi import AskonceASGIMiddleware

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise askonce.BudgetExhausted("spent", reply=Reply(0, True, "exhausted"), layer="db", key=None, attempts=3)

    sent: list[Any] = []

    async def receive() -> Any:
        return {"type": "http.request", "body": b""}

    async def send(message: Any) -> None:
        sent.append(message)

    before = askonce.stats()
    with pytest.raises(askonce.BudgetExhausted):  # too late for a 503: the server cuts the response
        await AskonceASGIMiddleware(app, layer="api")({"type": "http", "method": "GET", "path": "/", "headers": []},
                                                      receive, send)
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [200]
    assert askonce.stats().get("server.gave-up.exhausted", 0) == before.get("server.gave-up.exhausted", 0)
