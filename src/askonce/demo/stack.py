"""The demo's processes: started on free loopback ports, checked for readiness, and always stopped.

:class:`Stack` starts the gateway, api, service and target at once
(``python -m askonce.demo.<module>``, each in a session of its own with a pipe on stdin), reads the
port each one prints, and polls its health endpoint until it answers (bounded).
:meth:`Stack.close` sends SIGTERM, waits a grace period and SIGKILLs what is left; it runs on exit
(``atexit``) and on SIGTERM. Were the demo itself killed, its children see their stdin close and
exit on their own (see :mod:`askonce.demo.child`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx

# Seconds for every process to bind, announce its port and answer its health check.
START_TIMEOUT = 20.0
GRACE = 2.0  # seconds between SIGTERM and SIGKILL

# name -> module and arguments; the order is the call chain from the edge inward
LAYERS: dict[str, list[str]] = {
    "gateway": ["askonce.demo.layer_asgi", "--name", "gateway"],
    "api": ["askonce.demo.layer_wsgi"],
    "service": ["askonce.demo.layer_asgi", "--name", "service"],
    "target": ["askonce.demo.target"],
}
CHAIN = ("gateway", "api", "service", "target")


class StackError(RuntimeError):
    """A process of the stack did not start (its log says why)."""


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path | None
    url: str = ""


def _terminate_on_sigterm(signum: int, frame: Any) -> None:
    # Unwinds through the `finally` blocks and atexit, which stop the stack.
    raise SystemExit(128 + signum)


class Stack:
    """The four server processes of one demo run: ``with Stack() as stack: stack.ready(); ...``."""

    def __init__(self, log_dir: Path | None = None) -> None:
        self.log_dir = log_dir
        self.procs: dict[str, Proc] = {}
        self.started: list[int] = []  # every pid this stack ever started, restarts included
        self._closed = False

    def url(self, name: str) -> str:
        return self.procs[name].url

    def __enter__(self) -> Stack:
        """Register the clean-up and start the processes (without waiting: see :meth:`ready`)."""
        atexit.register(self.close)
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, _terminate_on_sigterm)
        try:
            self.spawn()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def spawn(self) -> None:
        """Start every process; they boot in parallel (with those of any other stack spawned
        meanwhile)."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for name, argv in LAYERS.items():
            log: IO[bytes] | int = subprocess.DEVNULL
            path = None
            if self.log_dir is not None:
                self.log_dir.mkdir(parents=True, exist_ok=True)
                path = self.log_dir / f"{name}.log"
                log = path.open("ab")
            popen = subprocess.Popen([sys.executable, "-m", *argv], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=log, env=env,
                                     start_new_session=True, close_fds=True)
            if not isinstance(log, int):
                log.close()  # the child has its own copy
            self.procs[name] = Proc(name, popen, path)
            self.started.append(popen.pid)

    def ready(self) -> None:
        """Wait (bounded) until every process has announced its port and answers its health
        check."""
        deadline = time.monotonic() + START_TIMEOUT
        for proc in self.procs.values():
            if not proc.url:
                proc.url = f"http://127.0.0.1:{self._read_port(proc, deadline)}"
        with httpx.Client(timeout=1.0, trust_env=False) as client:
            for proc in self.procs.values():
                self._wait_healthy(client, proc, deadline)

    def _read_port(self, proc: Proc, deadline: float) -> int:
        out = proc.popen.stdout
        assert out is not None
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or proc.popen.poll() is not None:
                raise StackError(self._why(proc, "did not announce its port"))
            ready, _, _ = select.select([out], [], [], min(left, 0.2))
            if ready:
                chunk = os.read(out.fileno(), 64)
                if not chunk:
                    raise StackError(self._why(proc,
                                               "closed its stdout before announcing its port"))
                line += chunk
        words = line.split()
        if len(words) != 2 or words[0] != b"port" or not words[1].isdigit():
            raise StackError(self._why(proc, f"announced {line!r} instead of its port"))
        return int(words[1])

    def _wait_healthy(self, client: httpx.Client, proc: Proc, deadline: float) -> None:
        while True:
            try:
                if client.get(proc.url + "/_demo/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proc.popen.poll() is not None:
                raise StackError(self._why(proc, "did not answer its health check"))
            time.sleep(0.05)

    def _why(self, proc: Proc, what: str) -> str:
        where = f"; see {proc.log}" if proc.log is not None else ""
        code = proc.popen.poll()
        exited = f" (exited with {code})" if code is not None else ""
        return f"the {proc.name} process {what}{exited}{where}"

    def restart(self) -> None:
        """Stop every process and start a fresh set (new ports): for a stack that would not
        settle."""
        self.close()
        self._closed = False
        self.procs = {}
        atexit.register(self.close)
        self.spawn()
        self.ready()

    def dead(self) -> list[str]:
        """The processes that have exited."""
        return [p.name for p in self.procs.values() if p.popen.poll() is not None]

    def close(self) -> None:
        """Stop every process: SIGTERM, then SIGKILL after the grace period. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        procs = list(self.procs.values())
        for proc in procs:
            if proc.popen.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.popen.stdin.close()  # a child also exits on its own when its stdin closes
            if proc.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + GRACE
        for proc in procs:
            try:
                proc.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait()
            if proc.popen.stdout is not None:
                proc.popen.stdout.close()
        atexit.unregister(self.close)
