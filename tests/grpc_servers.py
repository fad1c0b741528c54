"""Real gRPC servers on 127.0.0.1 for the tests: sync and ``grpc.aio`` servers on free ports, an event loop
in a thread for the aio ones, and a call without askonce on the client side."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterable, Sequence
from concurrent import futures
from typing import Any, TypeVar

import grpc
from grpc import aio

T = TypeVar("T")
Metadata = tuple[tuple[str, "str | bytes"], ...]


class LoopThread:
    """An event loop running in a daemon thread: aio servers live on it while sync tests call them."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def start_sync(*handlers: grpc.GenericRpcHandler, interceptors: Sequence[Any] = (),
               workers: int = 4) -> tuple[grpc.Server, str]:
    """A started sync server on a free port, and its address."""
    server = grpc.server(futures.ThreadPoolExecutor(workers), interceptors=list(interceptors))
    server.add_generic_rpc_handlers(handlers)
    url = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    return server, url


async def start_aio(*handlers: grpc.GenericRpcHandler, interceptors: Sequence[Any] = (),
                    migration_workers: int | None = None) -> tuple[aio.Server, str]:
    """A started ``grpc.aio`` server on a free port, and its address; run it on the server's loop.

    ``migration_workers``: a thread pool for sync handlers on the aio server (grpc.aio runs them there).
    """
    pool = None if migration_workers is None else futures.ThreadPoolExecutor(migration_workers)
    server = aio.server(pool, interceptors=list(interceptors))
    server.add_generic_rpc_handlers(handlers)
    url = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    return server, url


class ServerSet:
    """Servers started for a module, stopped in order by ``close``: the sync ones, the aio ones (on the loop,
    which they run on), then the loop."""

    def __init__(self) -> None:
        self.loop = LoopThread()
        self.sync_servers: list[grpc.Server] = []
        self.aio_servers: list[aio.Server] = []

    def add_sync(self, *handlers: grpc.GenericRpcHandler, interceptors: Sequence[Any] = (),
                 workers: int = 4) -> tuple[grpc.Server, str]:
        server, url = start_sync(*handlers, interceptors=interceptors, workers=workers)
        self.sync_servers.append(server)
        return server, url

    def add_aio(self, *handlers: grpc.GenericRpcHandler, interceptors: Sequence[Any] = (),
                migration_workers: int | None = None) -> tuple[aio.Server, str]:
        server, url = self.loop.run(start_aio(*handlers, interceptors=interceptors,
                                              migration_workers=migration_workers))
        self.aio_servers.append(server)
        return server, url

    def close(self) -> None:
        for server in self.sync_servers:
            server.stop(None)
        for aserver in self.aio_servers:
            self.loop.run(aserver.stop(None))
        self.loop.close()


def plain_call(url: str, method: str, request: bytes = b"", metadata: Metadata = (), timeout: float = 5,
               options: Sequence[tuple[str, Any]] = ()) -> tuple[grpc.StatusCode, dict[str, Any], bytes | None]:
    """A unary call without askonce on the client side: status, trailing metadata, and the body (None on error)."""
    with grpc.insecure_channel(url, options=list(options)) as ch:
        unary: grpc.UnaryUnaryMultiCallable[bytes, bytes] = ch.unary_unary(method)
        try:
            body, call = unary.with_call(request, timeout=timeout, metadata=metadata)
            return call.code(), _as_dict(call.trailing_metadata()), body
        except grpc.RpcError as e:
            return e.code(), _as_dict(e.trailing_metadata()), None


def _as_dict(metadata: Iterable[Any] | None) -> dict[str, Any]:
    return dict(metadata or ())
