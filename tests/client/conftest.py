"""The client tests' HTTP target (``http_target.Target``): one server per module, reset per test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from http_target import Target


@pytest.fixture(scope="module")
def _server() -> Iterator[Target]:
    t = Target()
    yield t
    t.close()


@pytest.fixture
def target(_server: Target) -> Target:
    _server.reset()
    return _server
