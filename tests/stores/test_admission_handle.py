"""The stores' admission handles: one per (target, policy), bounded, thread-safe around the core
``Admission`` (the Redis stores' shared handles: test_redis_admission.py)."""

from __future__ import annotations

import threading

import askonce
from askonce.core.admission import Admission, AdmissionPolicy
from askonce.stores.base import AdmissionHandle, Store
from askonce.stores.memory import MemoryStore
from stats_delta import delta

THREADS = 8
NEVER_SHEDS = AdmissionPolicy(min_requests=1_000_000_000)  # counts everything, refuses nothing


def clock() -> float:
    return 0.0


def test_the_memory_store_satisfies_the_protocol_and_keeps_one_handle_per_target_and_policy() -> None:
    store: Store = MemoryStore(clock)
    handle: AdmissionHandle = store.admission("svc", AdmissionPolicy())
    assert store.admission("svc", AdmissionPolicy()) is handle
    assert store.admission("svc", AdmissionPolicy(window=5)) is not handle
    assert store.admission("other", AdmissionPolicy()) is not handle
    assert handle.admit(0.0, 0.5)


def test_the_handle_decides_like_the_core() -> None:
    policy = AdmissionPolicy(window=10, min_requests=20)
    handle = MemoryStore(clock).admission("svc", policy)
    core = Admission(policy)
    draws = [(i * 0.37) % 1.0 for i in range(300)]
    for i, u in enumerate(draws):
        now = i / 100  # three seconds: the window does not roll past anything
        admitted = handle.admit(now, u)
        assert admitted == core.admit(now, u)
        if admitted:  # a success 1 time in 40: below min_success, so p is between 0 and 0.99
            handle.record(now, success=i % 40 == 0)
            core.record(now, success=i % 40 == 0)
    assert handle.snapshot() == core.snapshot()
    assert 0 < handle.reject_probability(3.0) == core.reject_probability(3.0) < 1


def test_admission_handles_are_bounded_and_evictions_counted() -> None:
    store = MemoryStore(clock, max_targets=2)
    before = askonce.stats()
    first = store.admission("a", AdmissionPolicy())
    store.admission("b", AdmissionPolicy())
    assert delta(before) == {}
    store.admission("c", AdmissionPolicy())
    assert delta(before) == {"store.memory.evicted": 1}
    assert store.admission("a", AdmissionPolicy()) is not first  # the oldest was dropped
    assert len(store._admissions) == 2


def test_threads_lose_no_admission_counts() -> None:
    handle = MemoryStore(clock).admission("svc", NEVER_SHEDS)
    n = 2000
    start = threading.Barrier(THREADS)

    def work() -> None:
        start.wait()
        for i in range(n):
            assert handle.admit(1.0, 0.5)
            handle.record(1.0, success=i % 4 != 0)

    threads = [threading.Thread(target=work) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = handle.snapshot()
    assert (snap["requests"], snap["calls"], snap["successes"]) == (THREADS * n, THREADS * n,
                                                                    THREADS * n * 3 // 4)
