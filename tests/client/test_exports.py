"""The public API is what __all__ says, nothing more: adding or removing a name is a decision."""

import pytest

import askonce

EXPECTED = {
    "AskonceError", "Backoff", "BreakerPolicy", "BucketPolicy", "BudgetExhausted", "CircuitOpen",
    "DeadlineExceeded", "DoNotRetry", "GaveUp", "Limits", "Question", "Reply", "RetryPolicy",
    "RetryThrottled", "__version__", "current", "fanout", "outgoing", "question", "retry", "serve",
    "stats",
}

# Names that had a second home at the top level; each now has one, in the module that owns it.
MOVED = {
    "BreakerRegistry": "askonce.breakers", "Failure": "askonce.core.retry", "Hop": "askonce.core.question",
    "NO_WAIT": "askonce.core.backoff", "QUESTION_HEADER": "askonce.core.wire", "REPLY_HEADER": "askonce.core.wire",
    "bind": "askonce.propagation", "extract": "askonce.propagation", "extract_reply": "askonce.propagation",
    "inject": "askonce.propagation", "new_key": "askonce.propagation",
}


def test_all_is_pinned() -> None:
    assert set(askonce.__all__) == EXPECTED


def test_every_exported_name_exists_and_is_documented() -> None:
    for name in askonce.__all__:
        obj = getattr(askonce, name)
        if callable(obj):
            assert obj.__doc__, f"askonce.{name} has no docstring"


@pytest.mark.parametrize(("name", "home"), sorted(MOVED.items()))
def test_a_moved_name_lives_in_one_place(name: str, home: str) -> None:
    import importlib

    assert getattr(importlib.import_module(home), name) is not None
    assert not hasattr(askonce, name)


def test_a_give_up_spells_its_reply_one_way() -> None:
    reply = askonce.Reply(0, True, "exhausted")
    err = askonce.BudgetExhausted("x", reply=reply, layer="api", key=None, attempts=1)
    assert err.askonce_reply is reply
    assert not hasattr(err, "reply")
