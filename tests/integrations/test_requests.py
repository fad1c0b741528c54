"""askonce.integrations.requests: the adapter and session against a real server on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import requests
from urllib3.util.retry import Retry

import askonce
from askonce import Backoff, Reply, RetryPolicy
from askonce.client import ClientPolicy, last_reply, replies
from askonce.core.backoff import NO_WAIT
from askonce.core.question import Hop
from askonce.core.wire import parse_dictionary
from askonce.integrations.requests import AskonceAdapter, default_target, session
from http_target import Target, policy, refused_url


def send(p: ClientPolicy, method: str, url: str, *, sleep: Any = None, timeout: Any = 5.0,
         adapter: dict[str, Any] | None = None, **kw: Any) -> requests.Response:
    with session(p, sleep=sleep, **(adapter or {})) as s:
        return s.request(method, url, timeout=timeout, **kw)


def test_a_failing_target_sees_at_most_one_plus_budget_arrivals_per_question(target: Target) -> None:
    p = policy(retry=RetryPolicy(attempts=10, backoff=NO_WAIT))
    keys = []
    with session(p) as s:
        for _ in range(5):
            with askonce.question(budget=2) as q:
                response = s.get(target.url("/fail"), timeout=5)
            keys.append(q.key)
            assert response.status_code == 503 and response.text == "no" * 10  # the body is still readable
            assert response.askonce_reply == Reply(0, True, "exhausted")  # type: ignore[attr-defined]
    assert [target.arrivals[k] for k in keys] == [3] * 5 and set(target.arrivals) == set(keys)


def test_the_key_is_forwarded_unchanged_and_the_path_shows_layer_and_attempt(target: Target) -> None:
    with askonce.question(budget=2) as q, askonce.propagation.bind(askonce.current(), path=(Hop("api", 1),)):  # type: ignore[arg-type]
        response = send(policy(), "GET", target.url("/fail/2"))
    assert response.status_code == 200 and response.text == "ok"
    assert [s.key for s in target.seen if s] == [q.key] * 3
    assert [tuple(map(str, s.path)) for s in target.seen if s] == [
        ("api:1", "web:1"), ("api:1", "web:2"), ("api:1", "web:3")]


def test_failed_attempts_release_their_connection(target: Target) -> None:
    with askonce.question(budget=2):
        response = send(policy(), "GET", target.url("/fail/2"), adapter={"pool_maxsize": 1, "pool_block": True})
    assert response.status_code == 200
    assert len(set(target.ports)) == 1  # bodies of failed attempts were read: the connection was reused


@pytest.mark.parametrize(("path", "arrivals", "waits"), [("/after/1", 2, [1.0]), ("/t429", 2, [1.0]),
                                                          ("/after/4", 1, [])])
def test_retry_after_is_honoured_up_to_max_pushback(path: str, arrivals: int, waits: list[float],
                                                    target: Target) -> None:
    slept: list[float] = []
    p = policy(retry=RetryPolicy(attempts=3, backoff=NO_WAIT, max_pushback=2.0))
    with askonce.question(budget=2):
        send(p, "GET", target.url(path), sleep=slept.append)
    assert slept == waits and target.total == arrivals


@pytest.mark.parametrize(
    ("method", "headers", "arrivals"),
    [("POST", {}, 1), ("PATCH", {}, 1), ("POST", {"Idempotency-Key": "order-7"}, 3), ("DELETE", {}, 3)],
)
def test_non_idempotent_requests_are_not_retried_unless_they_carry_a_key(method: str, headers: dict[str, str],
                                                                         arrivals: int, target: Target) -> None:
    with askonce.question(budget=2):
        response = send(policy(), method, target.url("/fail"), data=b"{}", headers=headers)
    assert response.status_code == 503 and target.total == arrivals


def test_a_body_that_cannot_be_replayed_is_sent_once(target: Target) -> None:
    with askonce.question(budget=2):
        response = send(policy(), "POST", target.url("/fail"), data=iter([b"chunk"]),
                        headers={"Idempotency-Key": "k"})
    assert response.status_code == 503 and target.total == 1


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_refused_connections_are_retried_without_spending_the_callees_budget(method: str) -> None:
    slept: list[float] = []
    p = policy(retry=RetryPolicy(attempts=3, backoff=Backoff(base=0.001, cap=0.001, jitter=False)))
    with askonce.question(budget=5), pytest.raises(requests.ConnectionError) as info:
        send(p, method, refused_url(), sleep=slept.append)
    assert slept == [0.001, 0.001]
    assert info.value.askonce_reply == Reply(3, True, "retried")  # type: ignore[attr-defined]


@pytest.mark.parametrize(("path", "cause"), [("/slow", requests.ReadTimeout), ("/close", requests.ConnectionError)])
def test_sent_and_lost_fails_closed(path: str, cause: type[Exception], target: Target) -> None:
    with askonce.question(budget=2), pytest.raises(askonce.BudgetExhausted) as info:
        send(policy(), "GET", target.url(path), timeout=0.2)
    assert isinstance(info.value.__cause__, cause)
    assert target.total == 1 and info.value.askonce_reply == Reply(0, True, "exhausted")


def test_do_not_retry_from_the_server_stops_retries_and_is_passed_on(target: Target) -> None:
    with askonce.question(budget=2), replies():
        response = send(policy(), "GET", target.url("/dnr"))
        passed_on = last_reply()
    assert response.status_code == 503 and target.total == 1
    assert passed_on is not None and passed_on.dnr and passed_on.reason == "overloaded"
    assert response.askonce_reply == passed_on  # type: ignore[attr-defined]


@pytest.mark.parametrize("timeout", [5.0, (5.0, 5.0), None])
def test_each_attempt_is_bounded_by_the_question_deadline(timeout: Any, target: Target) -> None:
    with askonce.question(budget=2, deadline=0.25), pytest.raises(askonce.GaveUp) as info:
        send(policy(), "GET", target.url("/slow"), timeout=timeout)
    assert isinstance(info.value.__cause__, requests.ReadTimeout)
    announced = parse_dictionary(target.raw[0] or "")
    assert isinstance(announced, dict) and 0 < int(announced["d"]) <= 250  # type: ignore[arg-type]


def test_a_flaky_target_is_answered_for_every_question(target: Target) -> None:
    with session(policy()) as s:
        statuses = []
        for _ in range(40):
            with askonce.question(budget=2):
                statuses.append(s.get(target.url("/flaky"), timeout=5).status_code)
    assert statuses == [200] * 40
    assert max(target.arrivals.values()) <= 3 and target.total < 40 * 1.3


@pytest.mark.parametrize("max_retries", [3, Retry(2), Retry(total=None, connect=2)])
def test_urllib3_retries_are_refused_so_two_retry_layers_never_stack(max_retries: Any) -> None:
    with pytest.raises(ValueError, match="max_retries"):
        AskonceAdapter(max_retries=max_retries)


@pytest.mark.parametrize("max_retries", [None, 0, Retry(0)])
def test_urllib3_retries_are_off(max_retries: Any) -> None:
    retries = AskonceAdapter(max_retries=max_retries).max_retries
    assert retries.total == 0 and retries.read is False


MISCONFIGURED: list[Any] = [
    pytest.param(lambda: AskonceAdapter(target="http://billing"), id="requests target not callable"),  # type: ignore[arg-type]
    pytest.param(lambda: session(target=42), id="session target not callable"),
    pytest.param(lambda: AskonceAdapter(sleep=5), id="sleep not callable"),
]


@pytest.mark.parametrize("make", MISCONFIGURED)
def test_a_misconfiguration_is_refused_at_construction(make: Callable[[], object]) -> None:
    with pytest.raises(ValueError):
        make()


def test_session_mounts_the_adapter_for_both_schemes() -> None:
    with session(ClientPolicy(layer="orders")) as s:
        http, https = s.get_adapter("http://x/"), s.get_adapter("https://x/")
    assert isinstance(http, AskonceAdapter) and http is https and http.caller.policy.layer == "orders"


def test_default_target_is_the_origin() -> None:
    assert default_target(requests.Request("GET", "http://svc/x").prepare()) == "http://svc:80"
    assert default_target(requests.Request("GET", "https://svc:8443/x").prepare()) == "https://svc:8443"


@pytest.mark.parametrize("bucket", [None, askonce.BucketPolicy()])
def test_the_target_is_computed_only_for_a_bucket_breaker_or_rejoin(bucket: Any, target: Target) -> None:
    asked: list[str] = []

    def target_of(request: requests.PreparedRequest) -> str:
        asked.append(request.url or "")
        return "billing"

    with session(policy(bucket=bucket, rejoin=False), target=target_of) as s:
        assert s.get(target.url("/fail/1"), timeout=5.0).status_code == 200
    assert len(asked) == (0 if bucket is None else 1)  # once per call, not per attempt
