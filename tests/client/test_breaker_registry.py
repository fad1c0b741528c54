"""Breakers by target: the registry, transition callbacks, the guard, what counts as a failure, and the
registry's options."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

import askonce
from askonce.breakers import BreakerRegistry, default_registry, is_failure, registry_for
from askonce.core.breaker import BreakerPolicy, State, Transition
from askonce.core.wire import Reply
from askonce.errors import CircuitOpen, attach_reply
from askonce.stores.memory import MemoryStore
from fake_clock import CLOSED, HALF, OPEN, POLICY, Clock


def registry(clock: Clock) -> BreakerRegistry:
    return BreakerRegistry(policy=POLICY, clock=clock)


def fail_through(reg: BreakerRegistry, target: str, n: int) -> None:
    for _ in range(n):
        with pytest.raises(ConnectionError), reg.get(target).guard():
            raise ConnectionError("down")


def test_one_breaker_per_target_as_named() -> None:
    reg = registry(Clock())
    assert reg.get("payments") is reg.get("payments")
    assert reg.get("payments") is not reg.get("payments/refund")
    assert reg.targets() == ["payments", "payments/refund"]
    with pytest.raises(ValueError, match="another policy"):
        reg.get("payments", BreakerPolicy(open_for=1.0))


def test_guard_opens_on_failures_and_then_refuses_with_circuit_open() -> None:
    clock = Clock()
    reg = registry(clock)
    fail_through(reg, "svc", 4)
    calls = 0
    with pytest.raises(CircuitOpen) as info, reg.get("svc").guard():
        calls += 1
    assert calls == 0
    err = info.value
    assert err.retry_at == 105.0 and err.reason == "breaker-open"
    assert err.askonce_reply == Reply(0, True, "breaker-open", 5.0)
    assert isinstance(err, askonce.GaveUp)


def test_circuit_open_inside_a_question_passes_its_budget_and_key_upstream() -> None:
    clock = Clock()
    reg = registry(clock)
    reg.get("svc").handle.force_open(clock.now)
    clock.now += 2.0
    with askonce.question(budget=3) as q, pytest.raises(CircuitOpen) as info, reg.get("svc").guard():
        pass
    assert info.value.askonce_reply == Reply(3, True, "breaker-open", 3.0)
    assert info.value.key == q.key


def test_callbacks_see_every_transition_in_order() -> None:
    clock = Clock()
    reg = registry(clock)
    seen: list[tuple[str, State, State, str]] = []

    @reg.on_transition
    def record(target: str, t: Transition) -> None:
        seen.append((target, t.old, t.new, t.reason))

    fail_through(reg, "svc", 4)
    clock.now += 5.0
    with reg.get("svc").guard():  # the probe
        pass
    assert seen == [("svc", CLOSED, OPEN, "failure-rate"), ("svc", OPEN, HALF, "open-elapsed"),
                    ("svc", HALF, CLOSED, "probes-succeeded")]
    reg.remove_callback(record)
    fail_through(reg, "svc", 4)
    assert len(seen) == 3


def test_a_failing_callback_is_counted_and_never_reaches_the_call() -> None:
    reg = registry(Clock())
    reg.on_transition(lambda target, t: 1 / 0)
    before = askonce.stats().get("breaker.listener.error", 0)
    fail_through(reg, "svc", 4)  # the fourth failure opens the breaker; its ConnectionError is intact
    assert askonce.stats()["breaker.listener.error"] == before + 1


def test_a_no_verdict_exception_frees_the_half_open_probe() -> None:
    clock = Clock()
    reg = registry(clock)
    breaker = reg.get("svc")
    breaker.handle.force_open(clock.now)
    clock.now += 5.0

    class ClientError(Exception):
        status_code = 404

    with pytest.raises(ClientError), breaker.guard():  # took the only probe, said nothing about health
        raise ClientError()
    with breaker.guard():  # so the next call may probe
        pass
    assert breaker.state() is CLOSED


def test_slow_calls_are_timed_by_the_guard() -> None:
    clock = Clock()
    policy = BreakerPolicy(window_size=4, minimum_calls=2, slow_call_duration=1.0, slow_call_rate=1.0)
    breaker = BreakerRegistry(policy=policy, clock=clock).get("svc")
    for _ in range(2):
        with breaker.guard():
            clock.now += 1.5
    assert breaker.state() is OPEN


async def test_async_with_works_on_a_sync_store() -> None:
    reg = registry(Clock())
    for _ in range(4):
        with pytest.raises(TimeoutError):
            async with reg.get("svc").guard():
                await asyncio.sleep(0)
                raise TimeoutError()
    with pytest.raises(CircuitOpen):
        async with reg.get("svc").guard():
            pass


async def test_cancellation_is_no_verdict() -> None:
    reg = registry(Clock())

    async def hang() -> None:
        async with reg.get("svc").guard():
            await asyncio.sleep(10)

    for _ in range(6):
        task = asyncio.create_task(hang())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert reg.get("svc").state() is CLOSED


def _with_reply(reason: str) -> Exception:
    exc = RuntimeError("callee said")
    attach_reply(exc, Reply(0, True, reason))
    return exc


class _Status(Exception):
    def __init__(self, status: int) -> None:
        self.status_code = status


class _Response:
    def __init__(self, status: int) -> None:
        self.status_code = status


class _HTTPError(Exception):
    def __init__(self, status: int) -> None:
        self.response = _Response(status)


@pytest.mark.parametrize(("exc", "counts"), [
    (ConnectionError(), True),
    (TimeoutError(), True),
    (_with_reply("overloaded"), True),     # the target asked us to back off: what breakers are for
    (_with_reply("exhausted"), False),     # the question ran out of budget: not the target's health
    (_with_reply("breaker-open"), False),  # an inner breaker is open: it already protects its target
    (_Status(503), True),
    (_Status(429), True),
    (_Status(408), True),
    (_Status(404), False),                 # the client's own 4xx
    (_HTTPError(400), False),              # requests/httpx shape: .response.status_code
    (_HTTPError(500), True),
    (KeyboardInterrupt(), False),
    (asyncio.CancelledError(), False),
])
def test_what_counts_as_a_failure(exc: BaseException, counts: bool) -> None:
    assert is_failure(exc) is counts


def test_a_custom_predicate_decides() -> None:
    reg = BreakerRegistry(policy=POLICY, clock=Clock(), is_failure=lambda exc: not isinstance(exc, KeyError))
    for _ in range(8):
        with pytest.raises(KeyError), reg.get("svc").guard():
            raise KeyError("not the target's fault")
    assert reg.get("svc").state() is CLOSED


def test_one_registry_per_store_and_a_default() -> None:
    store = MemoryStore(Clock())
    assert registry_for(store) is registry_for(store)
    assert registry_for(store).store is store
    assert default_registry() is default_registry()


def test_the_registry_is_bounded() -> None:
    reg = BreakerRegistry(policy=POLICY, clock=Clock(), max_targets=3)
    before = askonce.stats().get("breakers.registry.evicted", 0)
    for i in range(5):
        reg.get(f"t{i}")
    assert reg.targets() == ["t2", "t3", "t4"]
    assert askonce.stats()["breakers.registry.evicted"] == before + 2
    assert reg.states() == {"t2": CLOSED, "t3": CLOSED, "t4": CLOSED}


def test_a_flood_of_new_target_names_cannot_push_out_an_open_or_half_open_breaker() -> None:
    from stats_delta import delta

    clock = Clock()
    reg = BreakerRegistry(policy=POLICY, clock=clock)  # the default bound: 4096 targets
    fail_through(reg, "ledger", 4)
    probing = reg.get("ledger")
    clock.now += 5.0  # past open_for
    assert probing.state() is HALF
    fail_through(reg, "payments", 4)
    opened = reg.get("payments")
    before = askonce.stats()
    for i in range(2 * 4096):  # hostnames from webhooks
        reg.get(f"hook-{i}.example")
    assert len(reg.targets()) == 4096
    assert reg.get("payments") is opened and reg.get("ledger") is probing
    assert reg.states()["payments"] is OPEN and reg.states()["ledger"] is HALF
    with pytest.raises(CircuitOpen), reg.get("payments").guard():
        pass
    # the one probe is let through, and no second call while it runs
    with reg.get("ledger").guard(), pytest.raises(CircuitOpen), reg.get("ledger").guard():
        pass
    assert delta(before) == {"breakers.registry.evicted": 2 * 4096 - 4094,
                             "store.memory.evicted": 2 * 4096 - 4094}


def test_when_every_breaker_is_engaged_the_oldest_goes_and_is_counted_apart() -> None:
    from stats_delta import delta

    clock = Clock()
    reg = BreakerRegistry(policy=POLICY, clock=clock, max_targets=3)
    before = askonce.stats()
    for i in range(4):
        fail_through(reg, f"t{i}", 4)
    assert sorted(reg.targets()) == ["t1", "t2", "t3"]
    assert delta(before) == {"breakers.registry.evicted-engaged": 1}
    with pytest.raises(CircuitOpen), reg.get("t0").guard():  # the store still holds its state
        pass


# --- a misconfiguration is refused at construction ------------------------------------------------------


REFUSED: list[Any] = [
    pytest.param(lambda: BreakerRegistry(clock=5), id="registry clock not callable"),  # type: ignore[arg-type]
    pytest.param(lambda: BreakerRegistry(is_failure="yes"), id="registry is_failure not callable"),  # type: ignore[arg-type]
    pytest.param(lambda: BreakerRegistry(max_targets="10"), id="registry max_targets str (TypeError)"),  # type: ignore[arg-type]
    pytest.param(lambda: BreakerRegistry(max_targets=True), id="registry max_targets bool"),
    pytest.param(lambda: BreakerRegistry(store=object()), id="registry store not a store"),  # type: ignore[arg-type]
]


@pytest.mark.parametrize("make", REFUSED)
def test_a_misconfiguration_is_refused_at_construction(make: Callable[[], object]) -> None:
    with pytest.raises(ValueError):
        make()


def test_the_smallest_registry_stays_accepted() -> None:
    BreakerRegistry(max_targets=1, clock=lambda: 0.0)
