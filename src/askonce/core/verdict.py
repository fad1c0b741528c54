"""What an answer says about the target's health: the one rule every judge of a call uses.

A circuit breaker (and any protection that learns from outcomes) must only count what the target
itself did. A do-not-retry reply is usually about the *question*, not the target: its deadline had
passed, its key is over the target's cap, its budget is spent, a breaker or a throttle below
refused it. A caller controls all of those (a 1 ms deadline, a key re-sent at full speed), so
counting them against the target would let one client open a breaker for everyone. The one
do-not-retry that is a verdict is ``overloaded``: the callee itself saying it cannot take more.
"""

from __future__ import annotations

from askonce.core.wire import Reply

VERDICT_REASONS = frozenset({"overloaded"})
"""Do-not-retry reasons that count against the target; every other reason is no verdict."""


def health(failed: bool, reply: Reply | None) -> bool | None:
    """The verdict on the target of an answer that ``failed`` (or not), carrying ``reply``.

    ``True``: healthy; ``False``: failing; ``None``: no verdict (the answer is about the question).
    """
    if reply is not None and reply.dnr:
        return False if reply.reason in VERDICT_REASONS else None
    return not failed
