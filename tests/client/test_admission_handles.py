"""The admission handles a Caller keeps by target (``Caller._admission``): each call counts in the
handle its store holds for the target now, also after the store evicted the one the Caller kept;
at most ``_HANDLES`` are kept; a store of the application's own is asked on every call."""

from __future__ import annotations

from typing import Any

from askonce.client import _HANDLES, Caller, ClientPolicy, Outcome
from askonce.core.admission import AdmissionPolicy
from askonce.stores.memory import AdmissionHandle, MemoryStore

ADMISSION = AdmissionPolicy(min_requests=1_000_000_000)  # counts every attempt, refuses none
POLICY = ClientPolicy(admission=ADMISSION)
ANSWER = Outcome(None)


def frozen() -> float:
    return 100.0


class Answers:
    """An in-process exchange: every attempt is answered."""

    timeout = None

    def send(self, header: str, timeout: float | None) -> str:
        return "answer"

    def judge(self, response: str) -> Outcome:
        return ANSWER

    def judge_error(self, error: Exception) -> Outcome | None:
        return None

    def discard(self, response: object) -> None:
        pass


def requests(store: MemoryStore, target: str) -> Any:
    return store.admission(target, ADMISSION).snapshot()["requests"]


def test_calls_count_in_the_stores_handle_also_after_it_evicted_the_kept_one() -> None:
    store = MemoryStore(frozen, max_targets=1)
    caller = Caller(POLICY, store=store, clock=frozen)
    for _ in range(3):
        caller.call(Answers(), target="a")
    assert requests(store, "a") == 3
    store.admission("b", ADMISSION)  # one target only: "a"'s handle goes
    assert requests(store, "a") == 0  # a new one (and "b"'s goes)
    caller.call(Answers(), target="a")
    assert requests(store, "a") == 1


def test_at_most_so_many_handles_are_kept_and_every_call_still_counts() -> None:
    store = MemoryStore(frozen, max_targets=_HANDLES * 2)
    caller = Caller(POLICY, store=store, clock=frozen)
    targets = [f"t{i}" for i in range(_HANDLES + 10)]
    for target in targets * 2:
        caller.call(Answers(), target=target)
    assert caller._handles is not None and len(caller._handles) == _HANDLES
    assert all(requests(store, target) == 2 for target in targets)


class OwnStore:
    """A store of the application's own, with admission handles (and nothing to say when it drops
    one): the Caller must ask it every time."""

    def __init__(self) -> None:
        self.asked = 0
        self.handles: dict[str, AdmissionHandle] = {}

    def bucket(self, target: str, policy: Any) -> Any:
        raise AssertionError("no bucket in this policy")

    def breaker(self, target: str, policy: Any) -> Any:
        raise AssertionError("no breaker in this policy")

    def admission(self, target: str, policy: AdmissionPolicy) -> AdmissionHandle:
        self.asked += 1
        return self.handles.setdefault(target, AdmissionHandle(target, policy))


def test_a_store_of_its_own_is_asked_for_the_handle_on_every_call() -> None:
    store = OwnStore()
    caller = Caller(POLICY, store=store, clock=frozen)
    for _ in range(3):
        caller.call(Answers(), target="a")
    assert store.asked == 3
    assert store.handles["a"].snapshot()["requests"] == 3


class Counting(MemoryStore):
    """A memory store whose ``admission`` is its own: the Caller must not keep its handles."""

    def __init__(self) -> None:
        super().__init__(frozen)
        self.asked = 0

    def admission(self, target: str, policy: AdmissionPolicy) -> AdmissionHandle:
        self.asked += 1
        return super().admission(target, policy)


def test_a_memory_store_that_overrides_admission_is_asked_on_every_call() -> None:
    store = Counting()
    caller = Caller(POLICY, store=store, clock=frozen)
    for _ in range(3):
        caller.call(Answers(), target="a")
    assert store.asked == 3
