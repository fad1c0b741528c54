"""Every ``Record`` class behaves as the ``@dataclass(frozen=True, slots=True)`` it replaced.

Each is compared with a real dataclass built here from its ``__init__`` signature (names, order,
annotations, defaults), on the same values: repr, equality, hash, pickle state, copying, the
refusal to assign or delete, and ``dataclasses.fields``/``replace``/``asdict``/``astuple``.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle
from typing import Any

import pytest

from askonce.core.admission import AdmissionPolicy
from askonce.core.backoff import Backoff
from askonce.core.breaker import BreakerPolicy, State, Transition
from askonce.core.bucket import BucketPolicy
from askonce.core.question import Hop, Question
from askonce.core.record import Record
from askonce.core.retry import Failure, RetryPolicy
from askonce.core.sfv import Malformed
from askonce.core.wire import Limits, Reply

# One instance of every record class with no field at its default, and one with the defaults.
SAMPLES: list[Record] = [
    RetryPolicy(5, Backoff(0.1, 3.0, 1.5, False), 4, None, False, 0.5, 10.0, False),
    RetryPolicy(),
    Failure(False, Reply(1, True, "cap", 0.5, True), "lost", 2.0, True),
    Failure(),
    Limits(3, 9.5),
    Limits(),
    Reply(0, True, "exhausted", 1.25, True),
    Reply(2),
    Backoff(0.2, 4.0, 3.0, False),
    Backoff(),
    BucketPolicy(0.5, 3.0, 7.0),
    BucketPolicy(),
    AdmissionPolicy(20, 0.1, 0.5, 7, True),
    AdmissionPolicy(),
    Malformed("budget"),
    BreakerPolicy("time", 30, 5, 0.5, 0.8, 1.5, 4.0, 2),
    BreakerPolicy(),
    Transition(State.CLOSED, State.OPEN, 12.5, "failure-rate"),
    Question("k" * 20, "edge", True, 2, 3.5, (Hop("a", 1), Hop("b", 2)), b"sig"),
    Question("k" * 20, "edge", False, 0),
]
CLASSES: list[type[Record]] = sorted({type(s) for s in SAMPLES}, key=lambda c: c.__qualname__)


def _reference(cls: type) -> type:
    """The frozen, slotted dataclass ``cls`` would be, from its ``__init__`` signature alone."""
    spec = []
    for p in list(inspect.signature(cls).parameters.values()):
        default = dataclasses.MISSING if p.default is p.empty else p.default
        spec.append((p.name, p.annotation, dataclasses.field(default=default)))
    return dataclasses.make_dataclass(cls.__name__, spec, frozen=True, slots=True)


def _twin(record: Record) -> Any:
    values = [getattr(record, name) for name in type(record).__match_args__]
    return _reference(type(record))(*values)


def test_every_record_class_in_the_package_is_sampled() -> None:
    import askonce.core as core

    found = set()
    for info in __import__("pkgutil").walk_packages(core.__path__, "askonce.core."):
        module = __import__("importlib").import_module(info.name)
        found |= {v for v in vars(module).values()
                  if isinstance(v, type) and issubclass(v, Record) and v is not Record}
    assert found <= set(CLASSES), sorted(c.__qualname__ for c in found - set(CLASSES))


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__qualname__)
def test_fields_are_the_slots_the_match_args_and_the_init_parameters(cls: type[Record]) -> None:
    names = tuple(inspect.signature(cls).parameters)
    assert cls.__slots__ == cls.__match_args__ == names
    assert tuple(f.name for f in dataclasses.fields(cls)) == names
    assert dataclasses.is_dataclass(cls)
    reference = {f.name: (f.type, f.default) for f in dataclasses.fields(_reference(cls))}
    assert {f.name: (f.type, f.default) for f in dataclasses.fields(cls)} == reference
    assert not dataclasses.is_dataclass(Record)


@pytest.mark.parametrize("record", SAMPLES, ids=repr)
def test_a_record_behaves_as_its_dataclass_twin(record: Record) -> None:
    twin = _twin(record)
    name = type(record).__qualname__
    assert repr(record) == repr(twin)
    assert repr(record).startswith(name + "(")
    assert hash(record) == hash(twin)
    assert record.__getstate__() == twin.__getstate__()
    assert dataclasses.asdict(record) == dataclasses.asdict(twin)
    assert dataclasses.astuple(record) == dataclasses.astuple(twin)
    same = type(record)(*vars_of(record))
    assert same == record and same is not record and hash(same) == hash(record)
    assert record != twin  # another class, as two different dataclasses are never equal
    assert record.__eq__(object()) is NotImplemented
    # written for the class on first use, then called directly
    assert {"__repr__", "__eq__", "__hash__"} <= set(vars(type(record)))
    assert (repr(record), hash(record), record == same) == (repr(twin), hash(twin), True)


def vars_of(record: Record) -> list[Any]:
    return [getattr(record, name) for name in type(record).__match_args__]


@pytest.mark.parametrize("record", SAMPLES, ids=repr)
def test_a_record_is_frozen(record: Record) -> None:
    first = type(record).__match_args__[0]
    with pytest.raises(dataclasses.FrozenInstanceError, match=f"cannot assign to field '{first}'"):
        setattr(record, first, 1)
    with pytest.raises(dataclasses.FrozenInstanceError, match=f"cannot delete field '{first}'"):
        delattr(record, first)
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.other = 1  # type: ignore[attr-defined]
    assert not hasattr(record, "__dict__")


@pytest.mark.parametrize("record", SAMPLES, ids=repr)
@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_a_record_pickles_and_copies(record: Record, protocol: int) -> None:
    back = pickle.loads(pickle.dumps(record, protocol))
    assert back == record and type(back) is type(record)
    assert vars_of(back) == vars_of(record)
    assert copy.copy(record) == record
    assert copy.deepcopy(record) == record


# Protocol 4 pickles made by the dataclasses these records replaced (askonce 0.1.0 before them).
DATACLASS_PICKLES = [
    (RetryPolicy(5, Backoff(0.1, 3.0, 1.5, False), 4, None, False, 0.5, 10.0, False),
     b"\x80\x04\x95\x8e\x00\x00\x00\x00\x00\x00\x00\x8c\x12askonce.core.retry\x94\x8c\x0bRetryPolicy"
     b"\x94\x93\x94)\x81\x94]\x94(K\x05\x8c\x14askonce.core.backoff\x94\x8c\x07Backoff\x94\x93\x94)"
     b"\x81\x94]\x94(G?\xb9\x99\x99\x99\x99\x99\x9aG@\x08\x00\x00\x00\x00\x00\x00G?\xf8\x00\x00"
     b"\x00\x00\x00\x00\x89ebK\x04N\x89G?\xe0\x00\x00\x00\x00\x00\x00G@$\x00\x00\x00\x00\x00\x00"
     b"\x89eb."),
    (Reply(0, True, "exhausted", 1.25, True),
     b"\x80\x04\x95@\x00\x00\x00\x00\x00\x00\x00\x8c\x11askonce.core.wire\x94\x8c\x05Reply\x94\x93"
     b"\x94)\x81\x94]\x94(K\x00\x88\x8c\texhausted\x94G?\xf4\x00\x00\x00\x00\x00\x00\x88eb."),
    (Question("k" * 20, "edge", True, 2, 3.5, (Hop("a", 1),), b"sig"),
     b"\x80\x04\x95t\x00\x00\x00\x00\x00\x00\x00\x8c\x15askonce.core.question\x94\x8c\x08Question"
     b"\x94\x93\x94)\x81\x94]\x94(\x8c\x14kkkkkkkkkkkkkkkkkkkk\x94\x8c\x04edge\x94\x88K\x02G@\x0c"
     b"\x00\x00\x00\x00\x00\x00h\x00\x8c\x03Hop\x94\x93\x94\x8c\x01a\x94K\x01\x86\x94\x81\x94\x85"
     b"\x94C\x03sig\x94eb."),
]


@pytest.mark.parametrize(("record", "data"), DATACLASS_PICKLES, ids=lambda v: type(v).__name__)
def test_pickles_are_the_dataclasses_own(record: Record, data: bytes) -> None:
    assert pickle.loads(data) == record
    assert pickle.dumps(record, 4) == data


def test_replace_makes_a_validated_copy_and_leaves_the_original() -> None:
    policy = RetryPolicy(attempts=4)
    longer = dataclasses.replace(policy, deadline=60.0)
    assert (longer.deadline, longer.attempts, policy.deadline) == (60.0, 4, 30.0)
    assert policy.__replace__(budget=1) == RetryPolicy(attempts=4, budget=1)
    with pytest.raises(ValueError, match="attempts"):
        dataclasses.replace(policy, attempts=0)
    with pytest.raises(TypeError):
        dataclasses.replace(policy, nonsense=1)  # type: ignore[call-arg]


def test_a_dataclass_may_extend_a_record() -> None:
    @dataclasses.dataclass(frozen=True)
    class Tagged(Limits):
        tag: str = "x"

    t = Tagged(4, 5.0, "y")
    assert [f.name for f in dataclasses.fields(t)] == ["max_budget", "max_deadline", "tag"]
    assert (t.max_budget, t.max_deadline, t.tag) == (4, 5.0, "y")
    assert t != Tagged(4, 5.0, "z") and hash(t) == hash(Tagged(4, 5.0, "y"))
    back = copy.deepcopy(t)
    assert (back.max_budget, back.max_deadline, back.tag) == (4, 5.0, "y")
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.tag = "z"  # type: ignore[misc]


def test_validation_runs_on_construction() -> None:
    with pytest.raises(ValueError, match="budget"):
        Limits(max_budget=-1)
    with pytest.raises(ValueError, match="jitter"):
        Backoff(jitter="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="delivery"):
        Failure(delivery="maybe")
