"""Redis fixtures: a real ``redis-server`` started by the tests themselves (see ``redis_server.py``)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

from http_target import Target
from redis_server import REDIS_SERVER, RedisServer, redis_server

# Properties check logic, not speed: on a loaded machine input generation is slow and an example's
# run time says nothing, so neither may fail a test (every test's own settings inherit this).
settings.register_profile("askonce", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("askonce")


def _need_redis() -> None:
    if REDIS_SERVER is None:
        if os.environ.get("CI"):  # CI installs it (scripts/test.sh): a skip there would hide a broken install
            pytest.fail("redis-server is not installed, but CI must run the Redis tests")
        pytest.skip("redis-server is not installed")


@pytest.fixture(autouse=True)
def _forget_joining_callees() -> Iterator[None]:
    """What clients heard of callees that join is process-wide (askonce.client.JOINERS): a port
    one test's server had must not carry its answer into the next test."""
    from askonce.client import JOINERS, hedging

    JOINERS.clear()
    hedging.forget()  # what the hedgers learned of a port is process-wide too
    yield


@pytest.fixture(scope="session")
def shared_redis() -> Iterator[RedisServer]:
    """One server for tests that only need one; each test keys its own targets."""
    _need_redis()
    with redis_server() as server:
        yield server


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A server of this test's own, for tests that kill, pause or restart it."""
    _need_redis()
    with redis_server() as server:
        yield server


# --- the HTTP target of the client and integration tests (http_target.Target) ---------------------


@pytest.fixture(scope="module")
def http_server() -> Iterator[Target]:
    """One ``Target`` per test module."""
    t = Target()
    yield t
    t.close()


@pytest.fixture
def target(http_server: Target) -> Target:
    """The module's ``Target``, its counts reset for this test."""
    http_server.reset()
    return http_server
