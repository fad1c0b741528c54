"""One rule decides whether an answer counts against the target, and every judge applies it."""

from __future__ import annotations

import pytest

from askonce.core.verdict import health
from askonce.core.wire import REASONS, Reply

ABOUT_THE_QUESTION = [*sorted(REASONS - {"overloaded"}), "made-up-by-a-newer-peer"]


@pytest.mark.parametrize(("failed", "reply", "expected"), [
    (False, None, True),
    (True, None, False),
    (False, Reply(2), True),
    (True, Reply(1), False),  # a failure that says what it spent, nothing more
    (True, Reply(0, True, "overloaded", 1.0), False),  # the callee itself cannot take more
    *[(True, Reply(0, True, r), None) for r in ABOUT_THE_QUESTION],
    (True, Reply(0, True, None), None),  # do-not-retry without a reason: about the question
])
def test_health(failed: bool, reply: Reply | None, expected: bool | None) -> None:
    assert health(failed, reply) is expected
