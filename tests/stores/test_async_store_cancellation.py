"""A cancelled task stays cancelled when the store call it was waiting on finishes at that moment.

Python 3.11's ``asyncio.wait_for`` returns the inner result in that case and the cancellation is
lost: a caller cancelled (its client left) would go on to make the call it was guarding. redis-py's
asyncio client writes each command under its own ``wait_for``, so the Redis call itself can return
a reply after its task was cancelled; the store raises that lost cancellation."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from askonce.stores.aredis import AsyncRedisStore


async def test_a_cancellation_as_the_store_call_finishes_is_not_swallowed() -> None:
    store = AsyncRedisStore("redis://127.0.0.1:1/0", op_timeout=5.0)  # never connected
    for _ in range(20):
        done: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def call(answer: asyncio.Future[int]) -> int:
            return await answer

        task = asyncio.create_task(store.run(call(done)))
        for _ in range(3):
            await asyncio.sleep(0)  # the task now waits on the call
        done.set_result(1)
        task.cancel()  # in the same turn of the loop as the call's answer
        with pytest.raises(asyncio.CancelledError):
            await task


async def swallowing(reply: int) -> int:
    """A call that returns a reply though its task was cancelled, as redis-py's ``wait_for`` can."""
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.sleep(10)
    return reply


async def test_a_cancellation_the_redis_call_swallowed_is_raised() -> None:
    store = AsyncRedisStore("redis://127.0.0.1:1/0", op_timeout=5.0)  # never connected
    task = asyncio.create_task(store.run(swallowing(1)))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_timeout_the_redis_call_swallowed_is_still_a_timeout() -> None:
    store = AsyncRedisStore("redis://127.0.0.1:1/0", op_timeout=0.01)
    with pytest.raises(TimeoutError):
        await store.run(swallowing(1))


async def failing_after_swallowing() -> int:
    """A call that swallows its task's cancellation and then fails with an error of its own."""
    import redis

    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.sleep(10)
    raise redis.ConnectionError("closed while cancelled")


async def test_a_cancellation_swallowed_before_a_redis_error_is_raised_not_fallen_back() -> None:
    store = AsyncRedisStore("redis://127.0.0.1:1/0", op_timeout=5.0)
    task = asyncio.create_task(store.run(failing_after_swallowing()))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
