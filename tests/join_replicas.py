"""Replicas of one callee sharing joins through one real Redis: each a real uvicorn process.

``replicas(redis_url, n)`` starts ``n`` processes serving :func:`app` (``AskonceASGIMiddleware``
around ``JoinASGIMiddleware(store=RedisJoinStore(...))``) on free loopback ports and kills them at
the end. The handler counts its runs per question key in Redis (``runs:<key>``), the side effect
the tests check across processes. ``/slow`` takes 0.5 s; ``/hang`` takes 60 s on a question's
first run (a holder to kill) and none after; anything else answers at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import redis

import askonce
from asgi_body import read_body
from askonce.core.join import JoinPolicy
from askonce.integrations.asgi import AskonceASGIMiddleware
from askonce.integrations.asgi_join import JoinASGIMiddleware
from askonce.stores.join_redis import RedisJoinStore
from redis_server import free_port

LEASE = 1.0  # seconds: a killed holder blocks its question at most this long (and a slice)
HERE = pathlib.Path(__file__).resolve().parent


def app() -> Any:
    url = os.environ["JOIN_REDIS_URL"]
    counter = redis.Redis.from_url(url)

    async def handler(scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = await read_body(receive)
        q = askonce.current()
        runs = int(counter.incr(f"runs:{q.key if q is not None else '-'}"))
        if scope["path"] == "/slow":
            await asyncio.sleep(0.5)
        elif scope["path"] == "/hang" and runs == 1:
            await asyncio.sleep(60)
        out = b"answer to " + body + b" from " + str(os.getpid()).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": out})

    store = RedisJoinStore(url, lease=LEASE)
    return AskonceASGIMiddleware(JoinASGIMiddleware(handler, policy=JoinPolicy(ttl=60.0),
                                                    store=store), layer="callee")


@dataclass
class Replica:
    url: str
    proc: subprocess.Popen[bytes]

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)


def _ready(port: int, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"replica exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"replica on port {port} did not listen within {timeout} s")


@contextlib.contextmanager
def replicas(redis_url: str, n: int = 2) -> Iterator[list[Replica]]:
    env = {**os.environ, "JOIN_REDIS_URL": redis_url,
           "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), str(HERE),
                                          os.environ.get("PYTHONPATH", "")])}
    started: list[Replica] = []
    try:
        for _ in range(n):
            port = free_port()
            proc = subprocess.Popen(
                [sys.executable, "-m", "uvicorn", "join_replicas:app", "--factory", "--host",
                 "127.0.0.1", "--port", str(port), "--log-level", "warning"],
                cwd=HERE, env=env, stdout=subprocess.DEVNULL)
            started.append(Replica(f"http://127.0.0.1:{port}", proc))
        for r in started:
            _ready(int(r.url.rsplit(":", 1)[1]), r.proc)
        yield started
    finally:
        for r in started:
            r.kill()
