"""The in-memory store: buckets as before, lock-protected breaker handles, listeners, no lost counts."""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Callable
from typing import Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import askonce
from askonce.core.breaker import Breaker, BreakerPolicy, State, Transition
from askonce.core.bucket import BucketPolicy
from askonce.stores.base import BreakerHandle, Store
from askonce.stores.memory import MemoryStore

CLOSED, OPEN, HALF = State.CLOSED, State.OPEN, State.HALF_OPEN
SMALL = BreakerPolicy(window_size=10, minimum_calls=4, failure_rate=0.5, open_for=5.0, half_open_probes=2)


def clock() -> float:
    return 0.0


def test_store_satisfies_the_store_protocol() -> None:
    store: Store = MemoryStore(clock)
    handle: BreakerHandle = store.breaker("t", SMALL)
    assert handle.allow(0.0)


def test_bucket_keeps_its_behaviour() -> None:
    store = MemoryStore(clock)
    bucket = store.bucket("svc", BucketPolicy(ratio=0.5, floor=0.0, max_tokens=10))
    assert store.bucket("svc", BucketPolicy(ratio=0.5, floor=0.0, max_tokens=10)) is bucket
    for _ in range(4):
        bucket.deposit()
    assert bucket.tokens(0.0) == 2.0
    assert [bucket.withdraw(0.0) for _ in range(3)] == [True, True, False]


def test_one_breaker_per_target_and_policy() -> None:
    store = MemoryStore(clock)
    a = store.breaker("svc", SMALL)
    assert store.breaker("svc", SMALL) is a
    assert store.breaker("other", SMALL) is not a
    assert store.breaker("svc", BreakerPolicy()) is not a


def test_breakers_are_bounded_and_evictions_counted() -> None:
    store = MemoryStore(clock, max_targets=2)
    before = askonce.stats().get("store.memory.evicted", 0)
    first = store.breaker("a", SMALL)
    store.breaker("b", SMALL)
    store.breaker("c", SMALL)
    assert askonce.stats()["store.memory.evicted"] == before + 1
    assert store.breaker("a", SMALL) is not first  # "a" was the oldest and went first


def test_handle_runs_the_core_machine_and_reports_every_transition() -> None:
    handle = MemoryStore(clock).breaker("svc", SMALL)
    seen: list[tuple[str, State, State, str]] = []
    handle.add_listener(lambda target, t: seen.append((target, t.old, t.new, t.reason)))
    for _ in range(4):
        assert handle.allow(1.0)
        handle.record(1.0, success=False)
    assert handle.state(2.0) is OPEN and not handle.allow(2.0)
    assert handle.retry_at() == 6.0
    assert handle.allow(6.0) and handle.allow(6.0) and not handle.allow(6.0)  # two probes
    handle.release(6.5)  # a probe with no verdict frees its slot
    assert handle.allow(6.5)
    handle.record(7.0, success=True)
    handle.record(7.0, success=True)
    assert handle.state(7.0) is CLOSED
    assert seen == [("svc", CLOSED, OPEN, "failure-rate"), ("svc", OPEN, HALF, "open-elapsed"),
                    ("svc", HALF, CLOSED, "probes-succeeded")]


def test_force_open_of_an_elapsed_open_breaker_reports_both_moves() -> None:
    handle = MemoryStore(clock).breaker("svc", SMALL)
    moves: list[Transition] = []
    handle.add_listener(lambda target, t: moves.append(t))
    handle.force_open(0.0)
    handle.force_open(10.0)  # open -> half-open (elapsed at 5) -> open (forced) in one call
    handle.force_closed(11.0)
    assert [(t.old, t.new, t.reason, t.at) for t in moves] == [
        (CLOSED, OPEN, "forced", 0.0), (OPEN, HALF, "open-elapsed", 5.0), (HALF, OPEN, "forced", 10.0),
        (OPEN, CLOSED, "forced", 11.0)]


def test_a_failing_listener_is_counted_and_a_reentrant_one_does_not_deadlock() -> None:
    handle = MemoryStore(clock).breaker("svc", SMALL)
    states: list[State] = []

    def boom(target: str, t: Transition) -> None:
        raise RuntimeError("listener bug")

    handle.add_listener(boom)
    handle.add_listener(lambda target, t: states.append(handle.state(t.at)))  # calls back into the breaker
    before = askonce.stats().get("breaker.listener.error", 0)
    handle.force_open(1.0)
    assert states == [OPEN]
    assert askonce.stats()["breaker.listener.error"] == before + 1
    handle.remove_listener(boom)
    handle.force_closed(2.0)
    assert askonce.stats()["breaker.listener.error"] == before + 1


# --- the lock-free success path ----------------------------------------------------------------------


def core_counts(handle: object) -> tuple[object, ...]:
    # The core's own counters, before any fold: shows whether a success went through the lock.
    snap = handle._breaker.snapshot()  # type: ignore[attr-defined]
    return snap["calls"], snap["failures"]


def test_a_quiet_breaker_counts_successes_without_the_core_and_folds_them_in() -> None:
    handle = MemoryStore(clock).breaker("svc", SMALL)
    for ok in (False, True, True, True):  # the fourth call is judged: 1/4 failed, closed
        handle.record(1.0, success=ok)
    assert core_counts(handle) == (4, 1)
    for _ in range(3):
        handle.record(2.0, success=True)  # quiet now: the core does not see these yet
    handle.record(2.0, success=True, duration=99.0)  # SMALL judges no slowness: deferred as well
    assert core_counts(handle) == (4, 1)
    assert handle.snapshot()["calls"] == 8  # a snapshot folds them in
    assert core_counts(handle) == (8, 1)
    handle.record(3.0, success=True)
    handle.record(3.0, success=True)
    handle.record(3.0, success=False)  # folds the two before it first: 10 calls, then the failed one
    snap = handle.snapshot()
    assert (snap["calls"], snap["failures"]) == (10, 1)  # the first failure has left the 10-call window


def test_slow_successes_and_a_new_second_of_a_time_window_take_the_lock() -> None:
    policy = BreakerPolicy(window="time", window_size=10, minimum_calls=2, failure_rate=0.5,
                           slow_call_duration=1.0, slow_call_rate=0.5)
    handle = MemoryStore(clock).breaker("svc", policy)
    handle.record(5.0, success=True)
    handle.record(5.5, success=True)
    handle.record(5.9, success=True)  # quiet until second 6
    assert core_counts(handle) == (2, 0)
    handle.record(5.9, success=True, duration=1.0)  # slow: locked
    assert core_counts(handle) == (4, 0)
    handle.record(5.9, success=True)
    handle.record(6.0, success=True)  # a new second: locked, and the 5.9 success lands in second 5
    assert core_counts(handle) == (6, 0)
    assert handle.state(15.5) is CLOSED
    assert handle.snapshot()["calls"] == 1  # second 5 has left the window, second 6 has not


def test_a_success_that_read_a_stale_quiet_state_is_ignored_once_open() -> None:
    handle = MemoryStore(clock).breaker("svc", SMALL)
    moves: list[str] = []
    handle.add_listener(lambda target, t: moves.append(t.reason))
    for ok in (True, True, True, True, False, False, False, False):
        handle.record(1.0, success=ok)  # 4/8 opens on the last one
    assert handle.state(1.0) is OPEN
    handle._tally()  # type: ignore[attr-defined]  # a success that passed the quiet check before it opened
    assert handle.allow(6.0) and handle.allow(6.0)  # the fold found it in OPEN: it is no probe
    handle.record(6.0, success=True)
    assert handle.state(6.0) is HALF
    handle.record(6.0, success=True)
    assert handle.state(6.0) is CLOSED
    assert moves == ["failure-rate", "open-elapsed", "probes-succeeded"]


OPS = st.sampled_from(["allow", "ok", "ok", "ok", "ok", "slow-ok", "fail", "release", "state", "snapshot",
                       "force_open", "force_closed"])


@st.composite
def handle_policies(draw: st.DrawFn) -> BreakerPolicy:
    window: Literal["count", "time"] = draw(st.sampled_from(["count", "time"]))
    size = draw(st.integers(1, 8))
    return BreakerPolicy(
        window=window, window_size=size, minimum_calls=draw(st.integers(1, size if window == "count" else 6)),
        failure_rate=draw(st.sampled_from([0.25, 0.5, 1.0])), slow_call_rate=draw(st.sampled_from([0.5, 1.0])),
        slow_call_duration=draw(st.sampled_from([None, 1.0])), open_for=draw(st.sampled_from([1.0, 2.5])),
        half_open_probes=draw(st.integers(1, 3)))


@settings(max_examples=300, deadline=None)
@given(policy=handle_policies(), script=st.lists(st.tuples(OPS, st.sampled_from([0.0, 0.0, 0.25, 0.5, 1.0, 3.0])),
                                                 max_size=120))
def test_the_handle_with_deferred_successes_behaves_like_the_core(
    policy: BreakerPolicy, script: list[tuple[str, float]]
) -> None:
    # Time only moves forward here, as a monotonic clock does: a deferred success is folded in at the
    # latest time the core has seen, which can be earlier than its own (within the same second for a
    # time window), and that only matters to the core if a later call brings an earlier time.
    handle, core = MemoryStore(clock).breaker("svc", policy), Breaker(policy)
    moves: list[Transition] = []
    handle.add_listener(lambda target, t: moves.append(t))
    now = 1000.0
    for op, dt in script:
        now += dt
        if op == "allow":
            assert handle.allow(now) is core.allow(now)
        elif op in ("ok", "slow-ok", "fail"):
            duration = 2.0 if op == "slow-ok" else 0.0
            handle.record(now, success=op != "fail", duration=duration)
            core.record(now, success=op != "fail", duration=duration)
        elif op == "snapshot":
            # A snapshot shows the counters as of the latest time seen, and the lock-free paths (allow on
            # a closed breaker, a deferred success) pass no time to the core: show both the time first.
            assert handle.state(now) is core.state_at(now)
            assert handle.snapshot() | {"transitions_pending": 0} == core.snapshot() | {"transitions_pending": 0}
        elif op == "state":
            assert handle.state(now) is core.state_at(now)
        else:
            getattr(handle, op)(now)
            getattr(core, op)(now)
        assert handle.retry_at() == core.retry_at()
    assert handle.state(now) is core.state_at(now)
    assert moves == core.drain_transitions()


# --- concurrency: no lost counts -------------------------------------------------------------------

THREADS = 8


def hammer(n_threads: int, work: Callable[[], None]) -> None:
    # A tiny switch interval makes threads interleave as often as the interpreter allows. Checked by
    # removing the handle's locks: the half-open test then fails in every run. (Under the GIL the bucket
    # and window updates have no switch point inside them, so those two tests guard against regressions
    # that add one, and against free-threaded builds.)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        _hammer(n_threads, work)
    finally:
        sys.setswitchinterval(interval)


def _hammer(n_threads: int, work: Callable[[], None]) -> None:
    barrier = threading.Barrier(n_threads)
    errors: list[BaseException] = []

    def run() -> None:
        barrier.wait()
        try:
            work()
        except BaseException as exc:  # a failure in a thread must fail the test, not vanish
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors and not any(t.is_alive() for t in threads)


def test_threads_withdraw_exactly_the_tokens_there_are() -> None:
    bucket = MemoryStore(clock).bucket("svc", BucketPolicy(ratio=1.0, floor=0.0, max_tokens=1e9))
    for _ in range(5000):
        bucket.deposit()
    granted = [0] * THREADS

    def work(i: int) -> Callable[[], None]:
        def go() -> None:
            for _ in range(2000):
                granted[i] += bucket.withdraw(0.0)
        return go

    works = iter([work(i) for i in range(THREADS)])
    hammer(THREADS, lambda: next(works)())
    assert sum(granted) == 5000  # 16000 attempts for 5000 tokens: none lost, none made up


def test_threads_lose_no_breaker_records() -> None:
    policy = BreakerPolicy(window_size=100_000, minimum_calls=100_000, failure_rate=1.0)
    handle = MemoryStore(clock).breaker("svc", policy)

    def work() -> None:
        for i in range(3000):
            assert handle.allow(1.0)
            handle.record(1.0, success=i % 3 != 0)

    hammer(THREADS, work)
    snap = handle.snapshot()
    assert snap["calls"] == THREADS * 3000 and snap["failures"] == THREADS * 1000


@pytest.mark.parametrize("window", ["count", "time"])
def test_threads_lose_no_deferred_successes(window: Literal["count", "time"]) -> None:
    # Quiet from the 10th call on (failure_rate 1.0 never opens), so six threads succeed on the lock-free
    # path while two fail half their calls and fold the others' successes in under the lock. Checked by
    # giving the handle a counter that can lose a count at a thread switch: this test then fails (lost
    # counts, or a fold that finds the count gone back). With every thread failing often the test would
    # not notice: threads then switch on the lock, almost never inside the lock-free path.
    policy = BreakerPolicy(window=window, window_size=100_000 if window == "count" else 10, minimum_calls=10,
                           failure_rate=1.0)
    handle = MemoryStore(clock).breaker("svc", policy)
    ids = iter(range(THREADS))

    def work() -> None:
        failing = next(ids) < 2
        for i in range(6000):
            assert handle.allow(1.0)
            handle.record(1.0, success=not failing or i % 2 == 0)

    hammer(THREADS, work)
    snap = handle.snapshot()
    assert snap["calls"] == THREADS * 6000 and snap["failures"] == 2 * 3000


def test_threads_never_exceed_the_half_open_probes() -> None:
    policy = BreakerPolicy(window_size=10, minimum_calls=1, open_for=1.0, half_open_probes=3)

    def probes_admitted() -> int:
        handle = MemoryStore(clock).breaker("svc", policy)
        handle.force_open(0.0)
        admitted = [0] * THREADS
        slots = iter(range(THREADS))

        def work() -> None:
            i = next(slots)
            for _ in range(50):
                admitted[i] += handle.allow(2.0)

        hammer(THREADS, work)
        return sum(admitted)

    assert [probes_admitted() for _ in range(20)] == [3] * 20


@pytest.mark.parametrize("minimum_calls", [10_000, 10], ids=["locked", "deferred"])
async def test_tasks_lose_no_counts_across_awaits(minimum_calls: int) -> None:
    policy = BreakerPolicy(window_size=10_000, minimum_calls=minimum_calls, failure_rate=1.0)
    store = MemoryStore(clock)
    handle = store.breaker("svc", policy)
    bucket = store.bucket("svc", BucketPolicy(ratio=0.5, floor=0.0, max_tokens=1e9))
    granted = 0

    async def call(i: int) -> None:
        nonlocal granted
        bucket.deposit()
        assert handle.allow(1.0)
        await asyncio.sleep(0)  # other tasks run between admission and verdict
        handle.record(1.0, success=i % 2 == 0)
        await asyncio.sleep(0)
        granted += bucket.withdraw(1.0)

    await asyncio.gather(*(call(i) for i in range(2000)))
    snap = handle.snapshot()
    assert snap["calls"] == 2000 and snap["failures"] == 1000
    assert granted == 1000  # 2000 deposits at ratio 0.5


async def test_tasks_in_half_open_get_exactly_the_probes() -> None:
    handle = MemoryStore(clock).breaker("svc", SMALL)
    handle.force_open(0.0)

    async def probe() -> bool:
        await asyncio.sleep(0)
        return handle.allow(10.0)

    results = await asyncio.gather(*(probe() for _ in range(100)))
    assert sum(results) == SMALL.half_open_probes


@pytest.mark.parametrize("now", [float("nan"), float("inf")])
def test_a_non_finite_time_is_the_callers_bug(now: float) -> None:
    handle = MemoryStore(clock).breaker("svc", SMALL)
    with pytest.raises(ValueError):
        handle.record(now, success=True)


# --- eviction by state ----------------------------------------------------------------------------

OPENS_FAST = BreakerPolicy(minimum_calls=2, failure_rate=0.5, window_size=10, open_for=60.0)
ONE_RETRY = BucketPolicy(ratio=0.0, floor=1.0, max_tokens=0.0)  # one retry token, refilled at 1/s


def test_a_flood_of_new_targets_cannot_reset_an_open_breaker_or_a_drained_bucket() -> None:
    from stats_delta import delta

    store = MemoryStore(lambda: 0.0, max_targets=8)  # time stands still: nothing heals by itself
    victim = store.breaker("victim", OPENS_FAST)
    for _ in range(2):
        assert victim.allow(0.0)
        victim.record(0.0, success=False)
    assert victim.state(0.0) is State.OPEN
    drained = store.bucket("victim", ONE_RETRY)
    assert drained.withdraw(0.0) and not drained.withdraw(0.0)
    before = askonce.stats()
    for i in range(1000):  # hostnames from webhooks, user URLs...
        store.breaker(f"t{i}", OPENS_FAST)
        store.bucket(f"t{i}", ONE_RETRY)
    assert store.breaker("victim", OPENS_FAST) is victim and victim.state(0.0) is State.OPEN
    assert store.bucket("victim", ONE_RETRY) is drained and not drained.withdraw(0.0)
    assert len(store._breakers) == len(store._buckets) == 8
    assert delta(before) == {"store.memory.evicted": 2 * (1000 - 7)}


def test_when_every_entry_is_engaged_the_oldest_goes_and_is_counted_apart() -> None:
    from stats_delta import delta

    store = MemoryStore(lambda: 0.0, max_targets=3)
    before = askonce.stats()
    handles = []
    for i in range(4):
        b = store.breaker(f"t{i}", OPENS_FAST)
        for _ in range(2):
            b.allow(0.0)
            b.record(0.0, success=False)
        handles.append(b)
    assert [b.state(0.0) for b in handles] == [State.OPEN] * 4
    assert store.breaker("t0", OPENS_FAST) is not handles[0]  # the oldest engaged one went
    assert delta(before) == {"store.memory.evicted-engaged": 2}  # t0 for t3, then t1 for t0 again


def test_eviction_runs_no_listener_under_the_stores_lock() -> None:
    # An open breaker whose open period has passed is moved to half-open when read; if eviction
    # did that under the store's lock, a listener touching the store would wait on it for ever.
    now = [0.0]
    store = MemoryStore(lambda: now[0], max_targets=2)
    policy = BreakerPolicy(minimum_calls=1, window_size=1, open_for=1.0)
    seen: list[Transition] = []

    def listener(target: str, transition: Transition) -> None:
        seen.append(transition)
        store.bucket(f"from-listener-{len(seen)}", BucketPolicy()).tokens(now[0])

    b = store.breaker("a", policy)
    b.add_listener(listener)
    b.record(0.0, success=False)
    assert b.state(0.0) is State.OPEN and len(seen) == 1
    now[0] = 5.0
    flood = threading.Thread(target=lambda: (store.breaker("b", policy), store.breaker("c", policy)),
                             daemon=True)
    flood.start()
    flood.join(10)
    assert not flood.is_alive()
