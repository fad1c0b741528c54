"""The simulated client's hedging (``Policy.hedge``), as ``askonce.client.Caller.acall`` does it.

The layer nearest the target keeps a :class:`~askonce.core.hedge.Hedger` per instance (per client
when that layer is the client). Its first attempt of a call may hedge: one is reserved from the
question's account before the attempt holds the rest, and if no answer came after the hedger's
delay, the hedge goes out (hop ``layer:2``, the same deadline, no budget; the hedger's token spent).
Each try's answer or timeout goes to the call's :class:`~askonce.core.hedge.Race`; once it names the
try the call goes on with, what is held is settled, the other try is left to run (the real client
cancels it; the target's work goes on to its deadline, as the askonce ASGI middleware lets it), and
the call's loop is driven with that try's outcome, as the attempt's own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from askonce.core.hedge import FIRST, HEDGE, HedgePolicy, Hedger, Race
from askonce.core.retry import fits

if TYPE_CHECKING:
    from askonce._loop import Tried

# askonce.sim.model.Call, which imports this module (an arrow back would be a circle).
Call = Any


class _Hedged:
    """One call's race: its hedger, the two tries and their outcomes, when the first was sent."""

    __slots__ = ("hedger", "race", "sent", "tried", "tries")

    def __init__(self, hedger: Hedger, race: Race, first: Call, sent: float) -> None:
        self.hedger = hedger
        self.race = race
        self.sent = sent
        self.tries: list[Call | None] = [first, None]
        self.tried: list[Tried | None] = [None, None]


class Hedging:
    """The hedging of one simulated layer. ``send(c, now)``: send ``c``'s hedge (the model builds
    and schedules the message); ``drive(c, tried, now)``: go on with ``c``'s loop; ``at``: schedule
    an event; ``clock``: the virtual time."""

    __slots__ = ("_at", "_clock", "_drive", "_fire", "_races", "_send", "hedgers", "layer", "sent")

    def __init__(self, policy: HedgePolicy, layer: str, instances: int,
                 send: Callable[[Call, float], Call], drive: Callable[[Call, Tried, float], None],
                 at: Callable[[float, Callable[[Call], None], Call], None],
                 clock: Callable[[], float]) -> None:
        self.layer = layer
        self._clock = clock
        self.hedgers = [Hedger(policy) for _ in range(instances)]
        self._races: dict[Call, _Hedged] = {}
        self._send, self._drive, self._at = send, drive, at
        self._fire = self.fire
        self.sent = 0  # hedges sent in the run

    def plan(self, c: Call, number: int, now: float) -> float | None:
        """Before ``c`` sends attempt ``number``: the delay before its hedge, with one reserved
        for it (``None``: this attempt does not hedge). A first attempt races even so: its answer
        is a latency the hedger learns from."""
        layer = c.layer
        if number != 1 or c.state.rejoin or layer is None or layer.name != self.layer:
            return None
        hedger = self.hedgers[c.asked.client if len(self.hedgers) > 1 else 0]
        delay = hedger.plan(now)
        reserved = 0 if delay is None else c.tab.account.hold(1)
        self._races[c] = _Hedged(hedger, Race(c.tab.account, 0, reserved), c, now)
        return delay if reserved else None

    def started(self, c: Call, child: Call, delay: float | None, now: float) -> None:
        """``c``'s attempt ``child`` went out holding ``child.budget``: if it races, the hedge's
        timer (``delay``)."""
        hedged = self._races.get(c)
        if hedged is None:
            return
        hedged.race.held, hedged.tries[FIRST] = child.budget, child
        if delay is not None:
            self._at(now + delay, self._fire, c)

    def fire(self, c: Call) -> None:
        hedged = self._races.get(c)
        if hedged is None or hedged.race.done[FIRST]:
            return  # answered, or given up on, before the delay
        now = self._clock()
        if not fits(c.state.policy, c.tab.deadline, now) or not hedged.hedger.take(now):
            return
        hedged.race.fire()
        self.sent += 1
        hedged.tries[HEDGE] = self._send(c, now)

    def outcome(self, c: Call, child: Call, tried: Tried, now: float) -> bool:
        """``child``'s answer or timeout: ``False`` if ``c`` is not racing (the model goes on as
        usual); else the race hears it, and once it is decided, ``c``'s loop goes on."""
        hedged = self._races.get(c)
        if hedged is None:
            return False
        try:
            which = hedged.tries.index(child)
        except ValueError:
            return True  # an older attempt's: dropped, as the model drops it
        if hedged.tried[which] is not None:
            return True  # a try already heard (timed out, then answered): dropped
        hedged.tried[which] = tried
        hedged.hedger.heard(now, tried.reply)
        pick = hedged.race.heard(which, tried.failure)
        if pick is None:
            return True
        del self._races[c]
        race = hedged.race
        c.state.held = race.settle(pick)
        if race.fired:
            c.state.attempt = 2  # the hedge was this layer's second try
        outcome = hedged.tried[pick]
        assert outcome is not None
        if outcome.failure is None:
            hedged.hedger.observe(now - hedged.sent)
        c.out = None
        self._drive(c, outcome, now)
        return True
