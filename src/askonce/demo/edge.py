"""The edge: an open-loop load generator in the demo process, asking questions of the gateway.

Questions are launched on a seeded Poisson schedule whatever happens to earlier ones (users do not
wait for each other), over ``POOLS`` httpx clients: one shared ``AsyncClient`` stalls under
hundreds of idle connections, and a stall in the generator must not pass for one in the stack.
How late each launch was against its schedule is recorded and reported (``launch lag``).

Naive and no-retry edges try with the plain loop (``edge_attempts`` tries of ``edge_timeout`` each,
within the deadline). The askonce edge mints each question (key, budget, deadline) with
``askonce.question`` and calls through :class:`~askonce.integrations.httpx.AsyncAskonceTransport`.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

import askonce
from askonce.client import ClientPolicy
from askonce.core.backoff import Backoff
from askonce.core.retry import RetryPolicy
from askonce.demo import naive

POOLS = 16
CLIENT_ERROR = 599  # the edge's own request failed in a way no status describes
LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=64)
# Plain HTTP on loopback: verify=False only skips loading CA certificates (costly per client).


@dataclass(slots=True)
class Asked:
    """One question as the edge saw it; times in seconds from the start of the run."""

    key: str
    scheduled: float
    launched: float = -1.0
    ended: float = -1.0
    status: int = 0
    reason: str | None = None

    def ok(self, deadline: float) -> bool:
        return self.status == 200 and self.ended - self.launched <= deadline

    @property
    def done(self) -> bool:
        return self.ended >= 0


@dataclass(frozen=True, slots=True)
class EdgePlan:
    url: str
    policy: str  # "no-retry" | "naive" | "askonce"
    keys: list[str]
    schedule: list[float]
    deadline: float
    attempts: int
    timeout: float
    budget: int = 2
    grace: float = 0.0  # askonce: ClientPolicy.deadline_grace
    backoff_base: float = 0.05
    backoff_cap: float = 1.0
    seed: int = 1
    stop_at: float | None = None  # seconds: questions still open then are abandoned (not answered)
    store: Any = None  # askonce: where the edge's buckets live (None: a fresh in-memory store)
    respond_async: bool = False  # askonce: ask respond-async (ClientPolicy.respond_async)


def clients_for(plan: EdgePlan) -> list[httpx.AsyncClient]:
    if plan.policy != "askonce":
        return [httpx.AsyncClient(limits=LIMITS, trust_env=False, verify=False)
                for _ in range(POOLS)]
    from askonce.integrations.httpx import AsyncAskonceTransport

    store = plan.store
    if store is None:
        from askonce.stores.memory import MemoryStore

        store = MemoryStore(askonce._stats.monotonic)
    # rejoin (the library's default): toward a gateway that joins, the edge waits for the run of
    # its question instead of timing out into tries. In the overload the target bounds its queue
    # (adaptive concurrency), so waiting costs no queue depth (docs/demo.md, "Answering once").
    policy = ClientPolicy(
        layer="edge", originator=True, attempt_timeout=plan.timeout, deadline_grace=plan.grace,
        respond_async=plan.respond_async,
        retry=RetryPolicy(attempts=plan.attempts, budget=plan.budget, deadline=plan.deadline,
                          backoff=Backoff(base=plan.backoff_base, cap=plan.backoff_cap)),
    )  # fmt: skip
    return [httpx.AsyncClient(trust_env=False, transport=AsyncAskonceTransport(
        httpx.AsyncHTTPTransport(limits=LIMITS, verify=False), policy=policy, store=store))
        for _ in range(POOLS)]


async def _ask_naive(client: httpx.AsyncClient, plan: EdgePlan, asked: Asked, rng: random.Random,
                     deadline: float) -> None:
    asked.status = await naive.get_async(client, plan.url, {"x-question-id": asked.key},
                                         attempts=plan.attempts, timeout=plan.timeout,
                                         base=plan.backoff_base, cap=plan.backoff_cap, rng=rng,
                                         deadline=deadline)


async def _ask_askonce(client: httpx.AsyncClient, plan: EdgePlan, asked: Asked) -> None:
    async with askonce.question(budget=plan.budget, deadline=plan.deadline, key=asked.key,
                                origin="edge"):
        try:
            response = await client.get(plan.url, timeout=plan.timeout)
        except askonce.GaveUp as exc:
            asked.status, asked.reason = 503, exc.reason
            return
        except httpx.TimeoutException as exc:
            reply = getattr(exc, "askonce_reply", None)
            asked.status, asked.reason = naive.TIMED_OUT, getattr(reply, "reason", None)
            return
        except httpx.TransportError:
            asked.status = naive.UNREACHABLE
            return
        asked.status = response.status_code
        reply = askonce.propagation.extract_reply(response.headers)
        asked.reason = None if reply is None else reply.reason


async def run(plan: EdgePlan, start: float, tick: Callable[[int], None] | None = None,
              clients: list[httpx.AsyncClient] | None = None) -> list[Asked]:
    """Ask every question of the plan, launching each at ``start`` (``loop.time()``) plus its
    schedule.

    Returns when every question has an outcome, or at ``stop_at``: questions still open are
    cancelled and left without one (``done`` false). ``tick(n)`` is called with the number of
    finished questions. ``clients``: from :func:`clients_for`, made before ``start`` (making them
    takes time that must not delay the first launches).
    """
    loop = asyncio.get_running_loop()
    clients = clients if clients is not None else clients_for(plan)
    rng = random.Random(f"{plan.seed}:edge")
    asked = [Asked(key, t) for key, t in zip(plan.keys, plan.schedule, strict=True)]
    finished = 0

    async def one(i: int) -> None:
        nonlocal finished
        a = asked[i]
        a.launched = loop.time() - start
        client = clients[i % POOLS]
        try:
            # A safety net: each path has its own deadline.
            async with asyncio.timeout(plan.deadline + 1.0):
                if plan.policy == "askonce":
                    await _ask_askonce(client, plan, a)
                else:
                    await _ask_naive(client, plan, a, rng, loop.time() + plan.deadline)
        except TimeoutError:
            a.status = naive.TIMED_OUT
        except Exception as exc:  # anything else is a failed question, not a crashed generator
            a.status, a.reason = CLIENT_ERROR, type(exc).__name__
        a.ended = loop.time() - start
        finished += 1
        if tick is not None:
            tick(finished)

    tasks: list[asyncio.Task[None]] = []
    try:
        for i, t in enumerate(plan.schedule):
            delay = start + t - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(loop.create_task(one(i)))
        if tasks:
            timeout = None if plan.stop_at is None else max(0.0, start + plan.stop_at - loop.time())
            await asyncio.wait(tasks, timeout=timeout)
    finally:
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(c.aclose() for c in clients), return_exceptions=True)
    return asked
