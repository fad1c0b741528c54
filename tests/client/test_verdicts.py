"""Every judge of a call (HTTP, gRPC, exceptions) applies the one verdict rule."""

from __future__ import annotations

import grpc
import pytest

from askonce.client import ClientPolicy, judge_reply
from askonce.core.verdict import health
from askonce.core.wire import REASONS, Reply, format_reply
from askonce.errors import attach_reply
from askonce.integrations.grpc import judge_status
from askonce.verdict import is_failure


@pytest.mark.parametrize("reason", [*sorted(REASONS), "made-up-by-a-newer-peer"])
def test_every_judge_agrees_with_the_rule(reason: str) -> None:
    reply = Reply(0, True, reason)
    expected = health(True, reply)
    headers = {"askonce-reply": format_reply(reply)}
    for status in (503, 429, 500):
        assert judge_reply(ClientPolicy(), status, reply, headers).health is expected
    trailing = (("askonce-reply", format_reply(reply)),)
    for code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED):
        assert judge_status(code, None, trailing).health is expected
    exc = ConnectionError("downstream")
    attach_reply(exc, reply)
    assert is_failure(exc) is (expected is False)
