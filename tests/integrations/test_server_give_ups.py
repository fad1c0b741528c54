"""The server side every integration shares (``askonce.integrations._server.Server``): a give-up is answered
503 with a reply and a ``Retry-After`` that agree and stay within the protocol, and is counted by its reason
only when the reason is one the protocol knows."""

from __future__ import annotations

import math
from typing import Any

import pytest

import askonce
from askonce import Reply
from askonce.core import wire
from askonce.integrations._server import Server, ServerOptions


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
