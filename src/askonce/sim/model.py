"""The simulated stack: clients, retrying layers and a target, each hop driving the library's core.

A question is minted by a client (``mint_key`` with the run's seeded random bytes) and served by
layer 1, which calls layer 2, ... which calls the target. Every hop is a separate process in the
model: it gets its own :class:`~askonce.core.question.Tab` (a copy of the budget that arrived, like
``context.tab_from``), makes every decision with a :class:`~askonce.core.retry.RetryState`, holds
what it forwards in escrow (``RetryState.forward``) and settles it from the callee's :class:`Reply`
or, after a per-attempt timeout, as a lost call (fail closed), exactly as ``context.outgoing`` does.
In a run that neither joins nor hedges, a layer without a bucket or breaker makes its first attempt
as the client's fast path does (``askonce.client``): ``fits`` (written out), ``Account.hold`` and
``settle``, the state made, holding what was forwarded, only if it fails (the same run:
tests/sim/test_fast_paths.py). Token buckets, breakers and the target's
:class:`~askonce.core.ledger.Ledger` are the core classes too. The model only moves messages and
keeps time.

Policies without propagation model stacks that forward only an id header: each hop mints its own
local tab (a budget it cannot exhaust, no deadline), reads no reply and retries on its own. The id
header still reaches the target, so the ledger can count their arrivals per question as well.

Async mode (``Policy.respond_async``): a layer that rejoins asks its callee ``Prefer:
respond-async``; a callee that joins answers 202 at once (the run, or the wait for the run in
flight, goes on there) and the layer polls the status location (``Poll``) as the client does
(``askonce.client.asyncmode``): each poll asks to be held the whole seconds of min(the question's
time left, the layer's per-attempt timeout, ``MAX_LONG_POLL``) less ``POLL_MARGIN``; one held for
none is answered at once and the next follows ``POLL_GAP`` after it was sent; until the run's
answer, a 404 (no run there, or a failed one: fail closed) or the deadline. Polls are counted
(``Stats.polls``), never as arrivals; they spend no budget.

Headers are not serialised on the hot path, to keep each simulated hop cheap; the fast path
applies the wire's own millisecond rounding and the receiver's ``Limits``, and ``wire_text=True``
runs the real ``format_question``/``parse_question`` round trip on every hop instead (a test checks
both give the same numbers).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Generator
from functools import partial
from heapq import heappush
from math import log
from typing import ClassVar

from askonce._loop import ATTEMPT, IO, Ended, Step, Tried, joined_try, keep, steps
from askonce.core.admission import Admission
from askonce.core.breaker import Breaker
from askonce.core.bucket import TokenBucket
from askonce.core.concurrency import OVER, TOO_LATE, Limiter
from askonce.core.ledger import Ledger, LedgerPolicy
from askonce.core.question import Account, Hop, Tab, mint_key
from askonce.core.retry import (
    ANSWERED,
    LOST,
    Attempt,
    Failure,
    GiveUp,
    RetryPolicy,
    RetryState,
    Sent,
    attempt_window,
    settle,
)
from askonce.core.verdict import health
from askonce.core.wire import (
    MAX_BUDGET,
    MAX_DEADLINE_MS,
    Limits,
    Malformed,
    Reply,
    format_question,
    format_reply,
    parse_question,
    parse_reply,
)
from askonce.core.wire import to_ms as wire_ms  # the wire's own rounding: no drift on the fast path
from askonce.sim.engine import Engine, Event
from askonce.sim.hedging import Hedging
from askonce.sim.world import Policy, Stats, World

_new_tuple = tuple.__new__
# A target's plain answers (the budget only), shared: a Reply is immutable.
_REPLIES = tuple(Reply(n) for n in range(64))
_NREPLIES = len(_REPLIES)
# wire_ms's range, where it floors ``seconds * 1000 + 1e-6`` (``// 1``: the same, as a float)
# and clamps nothing
_WIRE_SECONDS = MAX_DEADLINE_MS / 1000
_FAILED = Tried(Failure(True, None, ANSWERED), False, None, ANSWERED)  # a failure without a reply
_TIMED_OUT = Tried(Failure(True, None, LOST), False)  # the attempt timed out: sent, no response
_REJOINABLE = Tried(Failure(True, None, LOST, joinable=True), False)  # ... to a callee that joins

_UNSPENDABLE = MAX_BUDGET  # a hop that gets no question: its own attempt limit is what stops it
MAX_LONG_POLL = 30  # whole seconds a status poll may ask to be held (``Prefer: wait=N``)
POLL_MARGIN = 0.2  # a poll asks to be held this much less than its caller would wait for it
POLL_GAP = 1.0  # seconds between polls answered at once (the callee's ``Retry-After: 1``)


def _wire_deadline(remaining: float, now: float, limits: Limits) -> float:
    """The deadline a callee reads from ``remaining`` seconds sent at ``now``: whole milliseconds,
    as on the wire (``format_question``, ``parse_question``), within ``limits``."""
    seconds = ((remaining * 1000 + 1e-6) // 1 / 1000 if 0 <= remaining <= _WIRE_SECONDS
               else wire_ms(remaining, up=False) / 1000)  # wire_ms, inline
    return now + (seconds if seconds < limits.max_deadline else limits.max_deadline)


class Asked:
    """The simulator's bookkeeping of one question: not the library's, which never sees it."""

    __slots__ = ("arrivals", "born", "client", "due", "key", "live", "polls")

    def __init__(self, key: str, client: int, born: float, due: float) -> None:
        self.key = key
        self.client = client
        self.born = born
        self.due = due
        self.arrivals = 0
        self.polls = 0  # status polls of async tries, at every hop
        self.live = 1  # hops and messages still able to cause an arrival; 0: the count is final


class Call:
    """One attempt sent from a hop to the next, and (at a layer) the callee's serving of it."""

    __slots__ = ("accepted", "arrived", "asked", "asks", "budget", "deadline", "guard", "held",
                 "layer", "loop", "ok", "out", "parent", "path", "patience", "rejoin", "remaining",
                 "reply", "sent", "started", "state", "tab", "waiting", "window")  # fmt: skip

    # Set when the call is served (a layer) or started (the target), not at creation.
    tab: Tab
    # None while the first attempt is out without one (``_serve``: as the client's fast path)
    state: RetryState | None
    held: int  # what that first attempt forwarded (``RetryState.forward`` with a state)
    window: Sent | None  # what ``RetryState.given`` would have noted for it
    # The library's one loop of attempts over the state; None while the first attempt is out
    # without it (no breaker: ``_serve``).
    loop: Generator[Step, object, Ended] | None
    guard: Admission | None  # the hop's admission controller (None: none)
    sent: float  # when this hop sent its outstanding attempt
    deadline: float | None  # at the target: the propagated deadline on its clock
    started: float  # at the target: when the work began
    arrived: float  # at the target, under a concurrency limit: when its slot was taken

    def __init__(self, asked: Asked, layer: Layer | None, parent: Call | None, budget: int = 0,
                 remaining: float | None = None, path: tuple[Hop, ...] = (), rejoin: bool = False,
                 asks: bool = False, patience: float | None = None) -> None:
        self.asked = asked
        self.layer = layer  # None: the target
        self.parent = parent
        self.out: Call | None = None  # the attempt this hop is waiting for
        self.budget = budget
        self.remaining = remaining  # the seconds the attempt gave the callee (propagated)
        self.path = path
        self.reply: Reply | None = None
        self.ok = False
        self.rejoin = rejoin  # a re-attach: joined, or refused, never run
        self.waiting = False  # at the target, under a concurrency limit: in the queue
        self.asks = asks  # asks respond-async (Policy.respond_async, toward a callee that joins)
        self.accepted = False  # answered 202: its caller polls, the answer goes to the polls
        self.patience = patience  # the caller's per-attempt timeout (caps each poll)


class Run:
    """A question's run at one hop that later arrivals join (``Policy.join``): the call serving
    it, the budget it was sent, the arrivals waiting for it, and whether it answered well."""

    __slots__ = ("budget", "call", "done", "polls", "waiters")

    def __init__(self, call: Call, budget: int) -> None:
        self.call = call
        self.budget = budget
        self.waiters: list[Call] = []
        self.polls: list[Poll] = []  # status polls held until the run answers
        self.done = False


class Poll:
    """One long-poll of an async try's status location: held at the callee up to ``wait``
    seconds; ``status`` what it came back with (200 the run's answer, 202 not yet, 404 none)."""

    __slots__ = ("child", "ok", "reply", "run", "sent", "status", "wait")

    def __init__(self, child: Call, wait: float, sent: float) -> None:
        self.child = child  # the try whose caller polls
        self.wait = wait  # 0: answered at once
        self.sent = sent
        self.run: Run | None = None  # where it is held
        self.status = 0  # 0: not answered yet
        self.ok = False
        self.reply: Reply | None = None


class Layer:
    __slots__ = ("admissions", "breakers", "buckets", "first", "name", "nxt", "per_client",
                 "plain", "retry")

    def __init__(self, name: str, retry: RetryPolicy, nxt: Layer | None, per_client: bool,
                 buckets: list[TokenBucket] | None, breakers: list[Breaker] | None,
                 admissions: list[Admission] | None = None) -> None:
        self.name = name
        self.first = Attempt(1, Hop(name, 1))  # its first attempt of a call
        self.retry = retry
        self.nxt = nxt
        self.per_client = per_client
        self.buckets = buckets
        self.breakers = breakers
        self.admissions = admissions
        self.plain = buckets is None and breakers is None  # its first attempt needs no loop


Failures = Callable[[float], bool]


class Sim:
    """One run of one policy in one world. ``run()`` returns the raw :class:`Stats`.

    ``failures(now) -> bool`` replaces the world's own failure draw (a test replays a sequence);
    ``wire_text`` serialises every header for real; ``trace`` keeps each question's arrivals.

    A subclass (``sim.fidelity.DemoSim``) may override ``_build``, ``_send``, ``_finish``,
    ``_accept``, ``_target_arrive`` and ``_start``, which the hot paths call. Other private
    methods may be written out where they run and are not points to override.
    """

    # A hop without a breaker makes its first attempt without the loop; False: always the loop
    # (the same run: tests/sim/test_fast_paths.py compares both).
    _first_without_loop: ClassVar[bool] = True

    def __init__(self, world: World, policy: Policy, seed: int = 1, *,
                 failures: Failures | None = None, wire_text: bool = False,
                 ledger: Ledger | None = None, trace: bool = False) -> None:
        self.world, self.policy, self.wire_text = world, policy, wire_text
        self.rng = random.Random(seed)
        self.engine = Engine()
        self.stats = Stats(world)
        if trace:
            self.stats.trace = []
        self.ledger = (ledger if ledger is not None
                       else Ledger(LedgerPolicy(window=86_400.0, max_exact_keys=200_000)))
        self.fails: Failures = failures if failures is not None else self._fails
        self.queue: deque[Call] = deque()
        self.busy = 0
        self.free_at = 0.0  # contention: when the write in progress ends
        self.layers = self._build()
        self._propagate, self._latency, self._timeout = (policy.propagate, world.latency,
                                                          world.timeout)
        self._grace, self._limits = policy.grace, world.limits
        # Bound once: scheduling an event then allocates only its tuple.
        self._on_issue, self._on_arrive, self._on_reply = (self.on_issue, self.on_arrive,
                                                           self.on_reply)
        self._on_timeout, self._on_resume, self._on_done = (self.on_timeout, self.on_resume,
                                                            self.on_done)
        # The virtual clock and the draws as C-level callables: the loop calls them on every step.
        self._clock: Callable[[], float] = partial(getattr, self.engine, "now")
        self._random = self.rng.random
        # The engine's heap and counter: the hot paths push ``(when, next(seq), fn, arg)``
        # themselves (``Engine.at`` written out: a Python-level call less per event).
        self._heap, self._seq = self.engine.heap, self.engine.seq
        # An event one hop's latency after now: the engine's FIFO (they come in the order they
        # run); with a horizon the heap, so that the events it cuts off are listed as before.
        self._soon: Callable[[Event], None] = (
            self.engine.fifo.append if world.horizon is None
            else partial(heappush, self.engine.heap))
        self._own_fails = failures is None  # the world's failure draw: inline at the target
        self._join = policy.propagate and policy.join
        self._runs: dict[tuple[str, str], Run] = {}  # (hop, key): runs later arrivals join
        self._edge_rejoins = self._join and policy.edge_rejoins
        self._async = self._join and policy.respond_async
        self._lifted = not world.transport_timeout  # a layer lifts its timeout toward a joiner
        self._on_accepted, self._on_poll = self.on_accepted, self.on_poll
        self._on_poll_expire, self._on_polled = self.on_poll_expire, self.on_polled
        self._on_poll_gap = self.on_poll_gap
        # The target's concurrency limit, as the server middleware keeps it: the core Limiter.
        self.limiter = (Limiter(policy.concurrency) if policy.concurrency is not None
                        and policy.propagate and not world.contention else None)
        self._on_expire = self.on_expire
        self.hedging = self._hedging()
        self._plain_send = self._propagate and not self._join and self.hedging is None
        # A first attempt without a state (``_serve``); False: every state made at once.
        self._stateless = self._plain_send and self._first_without_loop
        self._fast_arrive = self._stateless and not wire_text  # on_arrive's first case

    def _hedging(self) -> Hedging | None:
        """``Policy.hedge``: the layer nearest the target hedges (one hedger per client when that
        layer is the client, as each client process keeps its own)."""
        p, w = self.policy, self.world
        if p.hedge is None or not p.propagate:
            return None
        return Hedging(p.hedge, self.layers[-1].name, w.clients if w.depth == 1 else 1,
                       self._send_hedge, self._drive, self.engine.at, self._clock)

    def _build(self) -> list[Layer]:
        w, p = self.world, self.policy
        retry = RetryPolicy(attempts=p.attempts, backoff=p.backoff, budget=p.budget,
                            deadline=w.deadline if p.propagate else None)
        layers: list[Layer] = []
        nxt: Layer | None = None
        for i in range(w.depth, 0, -1):
            per_client = i == 1 and not p.shared
            n = w.clients if per_client else 1
            buckets = None if p.bucket is None else [TokenBucket(p.bucket, 0.0) for _ in range(n)]
            has_breaker = p.breaker is not None and (p.breaker_everywhere or i == w.depth)
            breakers = [Breaker(p.breaker) for _ in range(n)] if has_breaker and p.breaker else None
            admissions = (None if p.admission is None or i != w.depth
                          else [Admission(p.admission) for _ in range(n)])
            nxt = Layer(f"layer{i}", retry, nxt, per_client, buckets, breakers, admissions)
            layers.append(nxt)
        return layers[::-1]

    # --- the run ----------------------------------------------------------------------------------

    def run(self) -> Stats:
        self.engine.at(0.0, self._on_issue, 0)
        self.engine.run(self.world.horizon if self.world.horizon is not None else float("inf"))
        self._close_unfinished()
        return self.stats

    def _close_unfinished(self) -> None:
        """Questions a horizon cut off: count their arrivals so far and call them unfinished."""
        seen: set[int] = set()
        for event in [*self.engine.pending(), *self.queue]:
            item = event.child if isinstance(event, Poll) else event
            if isinstance(item, Call) and item.asked.live > 0 and id(item.asked) not in seen:
                seen.add(id(item.asked))
                self.stats.close(item.asked)
                self.stats.unfinished += 1

    def _fails(self, now: float) -> bool:
        w = self.world
        if w.outage is not None and w.outage[0] <= now < w.outage[1]:
            return True
        return w.error_rate > 0 and self.rng.random() < w.error_rate

    def on_issue(self, n: int) -> None:
        w, rng, now = self.world, self.rng, self.engine.now
        # rng.expovariate(w.rate) and rng.randbytes(16) written out, the same draws
        # (tests/sim/test_fast_paths.py): a Python-level call less each, once per question.
        gap = 1 / w.rate if w.even else -log(1.0 - rng.random()) / w.rate
        if now + gap < w.duration:
            heappush(self._heap, (now + gap, next(self._seq), self._on_issue, n + 1))
        client = n % w.clients if w.even else int(rng.random() * w.clients)
        key = mint_key(int(now * 1000), rng.getrandbits(128).to_bytes(16, "little"))
        due = now + w.deadline
        q = Asked(key, client, now, due)
        self.stats.issue(now)
        layer = self.layers[0]
        if not self._propagate:
            self._serve(Call(q, layer, None), Tab(key, "client", True, Account(_UNSPENDABLE), None),
                        (), now)
            return
        tab = Tab(key, "client", True, Account(self.policy.budget), due)
        self._serve(Call(q, layer, None), tab, (), now)

    # --- a layer ----------------------------------------------------------------------------------

    def _serve(self, c: Call, tab: Tab, path: tuple[Hop, ...], now: float) -> None:
        layer = c.layer
        assert layer is not None
        c.tab, c.path = tab, path
        buckets, breakers, admissions = layer.buckets, layer.breakers, layer.admissions
        if buckets is None and breakers is None and self._stateless:
            # The first attempt as the client's fast path makes it (``askonce.client``): no state
            # and no loop, made only if it fails (``_drive``); what RetryState.start would decide.
            admission = (None if admissions is None
                         else admissions[c.asked.client if layer.per_client else 0])
            c.guard = admission
            c.state = c.loop = None
            deadline = tab.deadline
            if deadline is not None and not now + layer.retry.min_attempt < deadline:  # fits
                self._finish(c, False, self._late(c, now), now)
            elif admission is not None and not admission.admit(now, self._random()):
                self._finish(c, False, self._state(c, 0, None).refused().reply, now)
            else:
                self._send(c, layer.first, now)
            return
        inst = c.asked.client if layer.per_client else 0
        bucket = None if buckets is None else buckets[inst]
        breaker = None if breakers is None else breakers[inst]
        admission = None if admissions is None else admissions[inst]
        c.state = state = RetryState(layer.retry, tab, layer.name, bucket is not None)
        if bucket is not None:
            bucket.deposit()
        c.guard = admission
        if breaker is None and self._first_without_loop:
            c.loop = None
            action = state.start(now)
            if type(action) is not Attempt:
                self._finish(c, False, action.reply, now)  # type: ignore[union-attr]
            elif admission is not None and not admission.admit(now, self._random()):
                self._finish(c, False, state.refused().reply, now)
            else:
                self._send(c, action, now)
            return
        c.loop = steps(state, clock=self._clock, random=self._random, bucket=bucket,
                       breaker=breaker, end=keep, admission=admission)
        self._drive(c, None, now)

    def on_arrive(self, c: Call) -> None:
        now = self.engine.now
        layer = c.layer
        if layer is not None and layer.plain and self._fast_arrive:
            # A layer with neither a bucket nor a breaker, in a run that neither joins nor hedges
            # (nothing else to decide on arrival): _receive without the header's text.
            self._serve(c, self._tab_of(c, now), c.path, now)
            return
        if layer is None:
            self._target_arrive(c, now)
            if c.asked.live == 0:  # its caller had already finished (a hedge that lost, in flight)
                self.stats.close(c.asked)
        elif self._propagate:
            if self.wire_text:
                tab, path = self._receive(c, now)
            else:
                tab, path = self._tab_of(c, now), c.path
            if self._join and self._joined(layer.name, c, tab.left, now):
                return
            if c.asks:
                self._accept(c, now)
            self._serve(c, tab, path, now)
        else:  # no question came: this hop's own tab, which only its attempt limit can exhaust
            self._serve(c, Tab(c.asked.key, layer.name, False, Account(_UNSPENDABLE), None), (),
                        now)

    def _receive(self, c: Call, now: float) -> tuple[Tab, tuple[Hop, ...]]:
        """The callee's view of ``c``'s question through the header's text (``wire_text``): its
        own tab with a copy of the budget. Without the text: :meth:`_tab_of`."""
        # Only the originator's own call has no parent, and it is never received.
        assert c.parent is not None
        sender = c.parent.tab
        text = format_question(sender.key, sender.origin, sender.edge, c.budget, c.remaining,
                               c.path)
        q = parse_question(text, now, self._limits)
        if isinstance(q, Malformed):  # cannot happen for format_question's output; fail loudly
            raise AssertionError(f"simulated header did not parse: {q.reason}: {text}")
        return Tab(q.key, q.origin, q.edge, Account(q.budget), q.deadline), q.path

    def _tab_of(self, c: Call, now: float) -> Tab:
        """:meth:`_receive` without the header's text: the deadline in whole milliseconds, as on
        the wire (``format_question``, ``parse_question``), the budget within the limits."""
        parent = c.parent
        assert parent is not None
        sender, limits, rem = parent.tab, self._limits, c.remaining
        deadline = None if rem is None else _wire_deadline(rem, now, limits)
        # c.budget was held: never negative. c.path: depth <= MAX_HOPS.
        budget = c.budget if c.budget <= limits.max_budget else limits.max_budget
        return Tab(c.asked.key, sender.origin, sender.edge, Account(budget), deadline)

    def _state(self, c: Call, held: int, window: Sent | None) -> RetryState:
        """The state of ``c``'s call, made after a first attempt sent without one (``held``
        forwarded, ``window`` noted), as the client's loop takes over (``_Call.loop``)."""
        layer = c.layer
        assert layer is not None
        c.state = state = RetryState(layer.retry, c.tab, layer.name, layer.buckets is not None)
        state.held, state.sent = held, window
        return state

    def _late(self, c: Call, now: float) -> Reply:
        """The reply of a first attempt its question's deadline leaves no time for (a state's
        ``start`` gives it up)."""
        action = self._state(c, 0, None).start(now)
        assert isinstance(action, GiveUp)
        return action.reply

    def _answered(self, c: Call, reply: Reply | None) -> Reply:
        """``c``'s attempt answered: what was held settled from ``reply``, and the reply for
        ``c``'s caller (``RetryState.on_success``, or ``settle`` without a state)."""
        state = c.state
        if state is not None:
            return state.on_success(reply, ANSWERED)
        account = c.tab.account
        settle(account, c.held, ANSWERED, reply)
        left = account.left
        return _REPLIES[left] if 0 <= left < _NREPLIES else Reply(left)

    def _drive(self, c: Call, value: object, now: float) -> None:
        """The simulator's driver of the one loop: store calls at once, a wait as a scheduled
        resume, an attempt as a message; the loop's end answers this hop's caller."""
        loop = c.loop
        if loop is None:  # the first attempt's outcome (``_serve``): ``value`` is its Tried
            tried: Tried = value  # type: ignore[assignment]
            admission = c.guard
            if admission is not None and tried.health is not None and not joined_try(tried):
                admission.record(now, success=tried.health)
            if tried.failure is None:
                state = c.state
                self._finish(c, True, self._answered(c, tried.reply) if state is None
                             else state.on_success(tried.reply, tried.delivery), now)
                return
            layer = c.layer
            assert layer is not None
            state = c.state
            if state is None:
                state = self._state(c, c.held, c.window)
            inst = c.asked.client if layer.per_client else 0
            c.loop = loop = steps(state, clock=self._clock, random=self._random,
                                  bucket=None if layer.buckets is None else layer.buckets[inst],
                                  end=keep, first=tried, admission=admission)
            value = None
        try:
            while True:
                kind, what = loop.send(value)
                if kind is IO:
                    value = what()
                elif kind is ATTEMPT:
                    self._send(c, what, now)
                    return
                else:
                    self.engine.at(now + what, self._on_resume, c)
                    return
        except StopIteration as end:
            ok, reply = end.value
            self._finish(c, ok, reply, now)

    def on_resume(self, c: Call) -> None:
        self._drive(c, None, self.engine.now)

    def _send(self, c: Call, act: Attempt, now: float) -> None:
        layer = c.layer
        assert layer is not None
        if self._plain_send:  # the general case below, for a layer that neither joins nor hedges
            state, asked, timeout, tab = c.state, c.asked, self._timeout, c.tab
            deadline = tab.deadline
            rem = None if deadline is None else deadline - now
            if timeout is not None and (rem is None or timeout < rem):
                rem = timeout
            if state is None:  # a first attempt without a state: what forward and given do
                account, grace = tab.account, self._grace
                budget = c.held = account.hold(account.left)
                if grace <= 0:  # attempt_window's case without a grace
                    remaining, c.window = rem, None
                else:
                    remaining, c.window = attempt_window(rem, grace, deadline, now)
                rejoin = False
            else:
                budget = state.forward()
                remaining = state.given(rem, self._grace, now)
                rejoin = state.rejoin
            path = c.path + (act.hop,)  # noqa: RUF005 (cheaper than unpacking into a new tuple)
            self._launch(c, Call(asked, layer.nxt, c, budget, remaining, path, rejoin, False,
                                 timeout), timeout, now)
            return
        # Toward a callee that joins, a layer waits for it (ClientPolicy.rejoin): no timeout of its
        # own, the question's deadline only (a transport's timeout it keeps).
        rejoins = self._join and (c.parent is not None or self._edge_rejoins)  # _rejoins(c)
        patience = self._timeout
        timeout = None if rejoins and self._lifted else patience
        hedging = self.hedging
        delay = None if hedging is None else hedging.plan(c, act.number, now)
        asked = c.asked
        if self._propagate:
            state = c.state
            assert state is not None  # made at once where a layer joins or hedges
            budget = state.forward()
            deadline = c.tab.deadline
            rem = None if deadline is None else deadline - now
            # the tighter of deadline and patience
            if timeout is not None and (rem is None or timeout < rem):
                rem = timeout
            remaining = state.given(rem, self._grace, now, rejoins)
            rejoin = state.rejoin
            # A re-attach is never answered 202 (the callee joins it to the run, or refuses it).
            child = Call(asked, layer.nxt, c, budget, remaining, (*c.path, act.hop), rejoin,
                         self._async and rejoins and not rejoin, patience)
        else:
            child = Call(asked, layer.nxt, c)
        self._launch(c, child, timeout, now)
        if hedging is not None:
            hedging.started(c, child, delay, now)

    def _launch(self, c: Call, child: Call, timeout: float | None, now: float) -> None:
        """``c``'s try ``child`` on its way: it arrives one hop's latency later, and times out after
        ``timeout`` unless answered first."""
        c.out = child
        c.sent = now
        child.asked.live += 1
        seq = self._seq
        self._soon((now + self._latency, next(seq), self._on_arrive, child))
        if timeout is not None:
            heappush(self._heap, (now + timeout, next(seq), self._on_timeout, child))

    def _send_hedge(self, c: Call, now: float) -> Call:
        """``c``'s hedge (``sim.hedging``): its layer's second try of the question, forwarding no
        budget, with the first try's patience."""
        layer = c.layer
        assert layer is not None
        child = Call(c.asked, layer.nxt, c)
        deadline, timeout = c.tab.deadline, self._timeout
        rem = None if deadline is None else deadline - now
        if timeout is not None and (rem is None or timeout < rem):
            rem = timeout
        child.remaining = attempt_window(rem, self.policy.grace, deadline, now)[0]
        child.path = (*c.path, Hop(layer.name, 2))
        c.asked.live += 1
        self.engine.at(now + self._latency, self._on_arrive, child)
        if timeout is not None:
            self.engine.at(now + timeout, self._on_timeout, child)
        return child

    def _tried(self, child: Call) -> Tried:
        """What an answered attempt came to, as its caller judges it."""
        reply = self._carry(child.reply) if self._propagate else None
        if child.ok:  # Tried(None, True, reply, ANSWERED), without its Python-level __new__
            return _new_tuple(Tried, (None, True, reply, ANSWERED, None, False, None))
        if reply is None:
            return _FAILED
        # Tried(Failure(True, reply, ANSWERED), health(True, reply), reply, ANSWERED), as above
        return _new_tuple(Tried, (Failure(True, reply, ANSWERED), health(True, reply), reply,
                                  ANSWERED, None, False, None))

    def on_reply(self, child: Call) -> None:
        c = child.parent
        assert c is not None
        now = self.engine.now
        if self.hedging is not None and self.hedging.outcome(c, child, self._tried(child), now):
            return
        if c.out is not child:  # the caller stopped waiting (timed out): the answer is dropped
            return
        c.out = None
        if child.ok and c.loop is None and not self.wire_text:
            # An answered first attempt: _drive's first case for _tried's Tried(None, True,
            # reply, ANSWERED), without building it.
            reply = child.reply if self._propagate else None
            if reply is not None and (reply.pushback is not None
                                      or not 0 <= reply.budget <= MAX_BUDGET):
                reply = self._carry(reply)
            guard = c.guard
            if guard is not None:
                guard.record(now, success=True)
            state = c.state
            reply = (self._answered(c, reply) if state is None
                     else state.on_success(reply, ANSWERED))
            self._finish(c, True, reply, now)
            return
        self._drive(c, self._tried(child), now)

    def _carry(self, reply: Reply | None) -> Reply | None:
        """A reply as the caller reads it off the wire."""
        if reply is None:
            return None
        if self.wire_text:
            parsed = parse_reply(format_reply(reply))
            if isinstance(parsed, Malformed):
                raise AssertionError(f"simulated reply did not parse: {parsed.reason}")
            return parsed
        if reply.pushback is None and 0 <= reply.budget <= MAX_BUDGET:
            return reply
        pushback = None if reply.pushback is None else wire_ms(reply.pushback, up=True) / 1000
        return Reply(max(0, min(reply.budget, MAX_BUDGET)), reply.dnr, reply.reason, pushback)

    def on_timeout(self, child: Call) -> None:
        c = child.parent
        assert c is not None
        if child.accepted:  # answered 202: the polls have their own bounds
            return
        lost = _REJOINABLE if self._rejoins(c) else _TIMED_OUT
        if self.hedging is not None and self.hedging.outcome(c, child, lost, self.engine.now):
            return
        if c.out is not child:
            return
        c.out = None
        self._drive(c, lost, self.engine.now)

    def _rejoins(self, c: Call) -> bool:
        """Does ``c``'s hop re-attach a timed-out try (its callee joins)?"""
        return self._join and (c.parent is not None or self._edge_rejoins)

    def _joined(self, hop: str, c: Call, budget: int, now: float) -> bool:
        """Join ``c`` to its question's run at ``hop`` (waiting, or replayed at once); if there is
        none to join, ``c`` becomes the run (and ``False``: serve it)."""
        key = (hop, c.asked.key)
        run = self._runs.get(key)
        if run is None and c.rejoin:  # nothing to join: refused, as the join middlewares do
            c.budget = 0
            self._answer_as(c, False, Reply(0, True, "exhausted"), now)
            return True
        if run is None:
            self._runs[key] = Run(c, budget)
            return False  # serve it (asked async, its 202 is sent where it is served)
        c.budget = budget
        if run.done:
            self._answer_waiter(run, c, now)
        elif c.asks:  # 202: its caller polls the run in flight
            self._accept(c, now)
            if c.layer is not None:  # (a target's job had no more arrivals in it already)
                self._gone(c.asked)
        else:
            run.waiters.append(c)
        return True

    def _answer_waiter(self, run: Run, c: Call, now: float) -> None:
        """A joined arrival gets the run's answer; its reply says what the run left, less the
        re-attaches its caller paid since (``integrations._join.joined``)."""
        reply = run.call.reply
        assert reply is not None
        left = max(0, min(c.budget, reply.budget - (run.budget - c.budget)))
        self._answer_as(c, run.call.ok, Reply(left, reply.dnr, reply.reason, reply.pushback), now)

    def _answer_as(self, c: Call, ok: bool, reply: Reply, now: float) -> None:
        """Answer an arrival that did not run: a layer's as the loop's end, a target's as a job."""
        if c.layer is not None:
            self._finish(c, ok, reply, now)
            return
        c.ok, c.reply = ok, reply
        self._reply(c, now)

    def _reply(self, c: Call, now: float) -> None:
        """Send ``c``'s answer to its caller, or, answered 202 before, to the polls of its run."""
        if not c.accepted:
            self.engine.at(now + self._latency, self._on_reply, c)

    def _gone(self, q: Asked) -> None:
        q.live -= 1
        if q.live == 0:
            self.stats.close(q)

    def _ran(self, hop: str, c: Call, now: float) -> None:
        """``c`` answered: its waiters get the answer; a good one is kept for later arrivals."""
        key = (hop, c.asked.key)
        run = self._runs.get(key)
        if run is None or run.call is not c:
            return
        run.done = True
        if not c.ok:
            del self._runs[key]  # a failed run is tried again by the next arrival
        waiters, run.waiters = run.waiters, []
        for waiter in waiters:
            self._answer_waiter(run, waiter, now)
        polls, run.polls = run.polls, []
        for poll in polls:
            if not poll.status:  # held: the answer, the run's as it is (no waiter's correction)
                self._polled(poll, 200, run, now)

    # --- async mode: 202 and status polls --------------------------------------------------------

    def _accept(self, c: Call, now: float) -> None:
        """``c`` asked respond-async of a callee that joins: answered 202 now."""
        c.accepted = True
        self.engine.at(now + self._latency, self._on_accepted, c)

    def on_accepted(self, child: Call) -> None:
        c = child.parent
        if c is not None and c.out is child:
            self._poll(child, self.engine.now)

    def _poll(self, child: Call, now: float) -> None:
        """The caller of an accepted try polls its status location, or, with no time left to,
        ends the try as lost (fail closed: the run may do the work)."""
        c = child.parent
        assert c is not None
        deadline = c.tab.deadline
        window = float(MAX_LONG_POLL) + POLL_MARGIN
        if child.patience is not None and child.patience < window:
            window = child.patience
        if deadline is not None:
            if deadline - now <= POLL_MARGIN / 4:
                c.out = None
                self._drive(c, _TIMED_OUT, now)
                return
            window = min(window, deadline - now)
        self.stats.polls += 1
        c.asked.polls += 1
        hold = int(window - POLL_MARGIN) if window > POLL_MARGIN else 0
        self.engine.at(now + self._latency, self._on_poll, Poll(child, float(hold), now))

    def on_poll_gap(self, child: Call) -> None:
        c = child.parent
        if c is not None and c.out is child:
            self._poll(child, self.engine.now)

    def on_poll(self, poll: Poll) -> None:
        """A poll at the callee: the run's kept answer, held until it answers (or ``wait``), or
        404 (no run there: never asked, or it failed)."""
        now, child = self.engine.now, poll.child
        hop = "target" if child.layer is None else child.layer.name
        run = self._runs.get((hop, child.asked.key))
        if run is None:
            self._polled(poll, 404, None, now)
        elif run.done:
            self._polled(poll, 200, run, now)
        elif poll.wait <= 0:
            self._polled(poll, 202, None, now)
        else:
            poll.run = run
            run.polls.append(poll)
            self.engine.at(now + poll.wait, self._on_poll_expire, poll)

    def on_poll_expire(self, poll: Poll) -> None:
        if not poll.status:
            run = poll.run
            if run is not None and poll in run.polls:
                run.polls.remove(poll)
            self._polled(poll, 202, None, self.engine.now)

    def _polled(self, poll: Poll, status: int, run: Run | None, now: float) -> None:
        poll.status = status
        if run is not None:
            poll.ok, poll.reply = run.call.ok, run.call.reply
        self.engine.at(now + self._latency, self._on_polled, poll)

    def on_polled(self, poll: Poll) -> None:
        """The poll's answer at the caller: poll again (202), fail closed (404), or the try's
        answer, read as if the first request had returned it."""
        child, now = poll.child, self.engine.now
        c = child.parent
        assert c is not None
        if c.out is not child:  # the caller stopped waiting (cut at its deadline)
            return
        if poll.status == 202:  # held to its end: again at once; else after the gap
            after = POLL_GAP - (now - poll.sent)
            if after > 0:
                self.engine.at(now + after, self._on_poll_gap, child)
            else:
                self._poll(child, now)
            return
        c.out = None
        if poll.status == 404:
            self._drive(c, _TIMED_OUT, now)
            return
        child.ok, child.reply = poll.ok, poll.reply
        self._drive(c, self._tried(child), now)

    def _finish(self, c: Call, ok: bool, reply: Reply, now: float) -> None:
        c.ok, c.reply = ok, reply
        if self._join and c.layer is not None:
            self._ran(c.layer.name, c, now)
        q = c.asked
        if c.parent is None:
            self.stats.answer(q, ok, now)
        elif not c.accepted:  # self._reply(c, now)
            self._soon((now + self._latency, next(self._seq), self._on_reply, c))
        q.live -= 1  # self._gone(q)
        if q.live == 0:
            self.stats.close(q)

    # --- the target -------------------------------------------------------------------------------

    def _target_arrive(self, job: Call, now: float) -> None:
        q = job.asked
        q.arrivals += 1
        q.live -= 1  # a job can answer, but it cannot cause another arrival
        self.stats.arrival(now)
        shed = self.policy.shed
        if self._propagate:
            if self.wire_text:
                tab, path = self._receive(job, now)
                key, edge, origin = tab.key, tab.edge, tab.origin
                budget, deadline = tab.left, tab.deadline
            else:  # _tab_of's values, without the tab
                parent = job.parent
                assert parent is not None
                sender, limits, rem = parent.tab, self._limits, job.remaining
                deadline = None if rem is None else _wire_deadline(rem, now, limits)
                budget = job.budget if job.budget <= limits.max_budget else limits.max_budget
                key, edge, origin, path = q.key, sender.edge, sender.origin, job.path
            self.ledger.record(now, "target", key=key, edge=edge, origin=origin, path=path)
            job.budget, job.deadline = budget, deadline
            if self._join and self._joined("target", job, budget, now):
                return
        else:  # an id header only: the key is known, the path and the deadline are not
            self.ledger.record(now, "target", key=q.key, edge=True)
            job.deadline = deadline = None
        if shed and deadline is not None and now >= deadline:
            self._target_answer(job, False, True, now)
            return
        limiter = self.limiter
        if limiter is not None:
            # The middleware's decision at the door (Limiter.enter), the deadline only when shed.
            entered = limiter.enter(now, deadline if shed else None)
            if entered == TOO_LATE:
                self._target_answer(job, False, True, now)  # as the middleware: dnr deadline
                return
            if entered == OVER:
                # Over the limit: answered at once, do not retry, with the policy's pushback.
                self.stats.overloaded += 1
                job.ok, job.reply = False, Reply(job.budget, True, "overloaded",
                                                 limiter.policy.pushback)
                self.engine.at(now + self.world.latency, self._on_reply, job)
                if self._join:
                    self._ran("target", job, now)
                return
            job.arrived = now
        if job.asks:  # admitted to run, asked async: 202 now, the work goes on
            self._accept(job, now)
        if self.world.contention:
            if now < self.free_at:  # optimistic concurrency: a conflict is known at once
                self._target_answer(job, False, False, now)
                return
            self.free_at = now + self.world.service
            job.started = now
            job.ok = not self.fails(now)
            self.engine.at(self.free_at, self._on_done, job)
        elif self.world.servers is None:
            job.started = now
            w = self.world
            if self._own_fails:  # _fails, inline
                outage = w.outage
                job.ok = not ((outage is not None and outage[0] <= now < outage[1])
                              or (w.error_rate > 0 and self._random() < w.error_rate))
            else:
                job.ok = not self.fails(now)
            service = (w.service if w.slow_share <= 0 and w.spread <= 0  # _service, inline
                       else self._service())
            heappush(self._heap, (now + service, next(self._seq), self._on_done, job))
        elif self.busy < self.world.servers:
            self._start(job, now)
        else:
            self.queue.append(job)
            if limiter is not None and self.policy.shed and job.deadline is not None:
                # The middleware cancels a request at its deadline wherever it waits in the app:
                # its slot is free then, not when the queue reaches it.
                job.waiting = True
                self.engine.at(job.deadline, self._on_expire, job)

    def on_expire(self, job: Call) -> None:
        """A queued request's deadline passed (a concurrency limit only): cancelled, slot freed."""
        if job.waiting:  # still queued: the queue is at most the limit long
            job.waiting = False
            self.queue.remove(job)
            now = self.engine.now
            self._release(job, False, now)
            self._target_answer(job, False, True, now)

    def _release(self, job: Call, ok: bool, now: float) -> None:
        if self.limiter is not None:
            self.limiter.release(now, now - job.arrived, ok)

    def _start(self, job: Call, now: float) -> None:
        w, deadline = self.world, job.deadline
        job.waiting = False
        if self.policy.shed and deadline is not None and now >= deadline:
            self._release(job, False, now)
            self._target_answer(job, False, True, now)  # refused before work: its caller has gone
            return
        self.busy += 1
        service = self._service()
        if w.cut is not None and w.cut[0] <= now < w.cut[1]:
            service /= w.cut[2]
        end = now + service
        job.started = now
        if self.policy.shed and deadline is not None and deadline < end:
            # cancelled at its deadline
            end, job.ok, job.reply = deadline, False, Reply(job.budget, True, "deadline")
        else:
            job.ok, job.reply = not self.fails(now), None
        self.engine.at(end, self._on_done, job)

    def _service(self) -> float:
        """This arrival's work: the world's service time, or its slow time for a share."""
        w = self.world
        if w.slow_share > 0 and self.rng.random() < w.slow_share:
            return w.slow_time
        if w.spread > 0:
            return w.service * (1 + w.spread * (2 * self.rng.random() - 1))
        return w.service

    def on_done(self, job: Call) -> None:
        now = self.engine.now
        work = now - job.started
        stats = self.stats
        stats.busy += work
        parent = job.parent
        if parent is not None and parent.out is not job:  # its caller has gone: wasted, unless
            run = self._runs.get(("target", job.asked.key)) if self._join else None
            if not (run is not None and run.call is job and run.waiters):  # others wait for it
                stats.wasted += work
        reply = job.reply
        ok = job.ok and reply is None  # neither failed nor cancelled at its deadline
        if reply is not None:  # cancelled at its deadline
            self.stats.shed += 1
            self._reply(job, now)
            if self._join:
                self._ran("target", job, now)
        else:
            self._target_answer(job, job.ok, False, now)
        self._release(job, ok, now)
        if self.world.servers is not None:
            self.busy -= 1
            queue = self.queue
            while queue and self.busy < self.world.servers:
                self._start(queue.popleft(), now)

    def _target_answer(self, job: Call, ok: bool, shed: bool, now: float) -> None:
        job.ok = ok
        if shed:
            self.stats.shed += 1
            job.reply = Reply(job.budget, True, "deadline")
        else:
            budget = job.budget
            job.reply = (None if not self._propagate else _REPLIES[budget]
                         if 0 <= budget < _NREPLIES else Reply(budget))
        self._reply(job, now)
        if self._join:
            self._ran("target", job, now)
