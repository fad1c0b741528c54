"""What every demo process does around its app: bind a free port, say which, die with its parent.

A process of the stack is started as ``python -m askonce.demo.<module>`` with a pipe on stdin. It
binds 127.0.0.1 port 0, prints ``port <n>`` on stdout (the one line the parent reads) and serves.
It exits at once on SIGTERM, ignores SIGINT (the parent owns Ctrl-C and stops its children
itself), and exits when its stdin reaches end-of-file or its parent changes: a demo killed with
SIGKILL leaves no orphans.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

PARENT_POLL = 0.5  # seconds between checks that the parent is still there


def _exit_now(*_: object) -> None:
    os._exit(0)


def _watch_stdin() -> None:
    try:
        while sys.stdin.buffer.read(4096):
            pass
    except (OSError, ValueError):
        pass
    os._exit(0)  # the parent is gone (or closed our pipe to stop us)


def _watch_ppid(parent: int) -> None:
    while True:
        time.sleep(PARENT_POLL)
        if os.getppid() != parent:
            os._exit(0)


def prepare() -> None:
    """Signals, the parent watchers and a file-descriptor limit fit for thousands of connections."""
    signal.signal(signal.SIGTERM, _exit_now)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_stdin, name="demo-stdin", daemon=True).start()
    threading.Thread(target=_watch_ppid, args=(os.getppid(),), name="demo-ppid",
                     daemon=True).start()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE,
                               (hard if hard != resource.RLIM_INFINITY else 65_536, hard))


def announce(port: int) -> None:
    sys.stdout.write(f"port {port}\n")
    sys.stdout.flush()


def serve_asgi(app: Any) -> None:
    """Serve an ASGI app with uvicorn on a free loopback port until stopped."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted sockets inherit it; without it every response waits 40 ms for a delayed ACK (Nagle).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                            backlog=4096, timeout_keep_alive=30)

    class Server(uvicorn.Server):
        """uvicorn's server without its signal handling: this process has its own (exit at once)."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    announce(sock.getsockname()[1])
    asyncio.run(Server(config).serve(sockets=[sock]))


def serve_wsgi(app: Callable[..., Any], threads: int) -> None:
    """Serve a WSGI app with waitress on a free loopback port until stopped."""
    import waitress  # type: ignore[import-untyped]

    server = waitress.create_server(app, host="127.0.0.1", port=0, threads=threads,
                                    connection_limit=4096, backlog=4096, asyncore_use_poll=True,
                                    channel_timeout=60, ident="askonce-demo")
    announce(server.effective_port)
    server.run()
