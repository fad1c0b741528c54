"""A real ``redis-server`` for tests: a free loopback port, a temp dir, no persistence, killed at the end.

``stop()`` kills it with SIGKILL (a crash, not a clean shutdown), ``start()`` brings it back on the same
port with empty state (``--save ""``, ``--appendonly no``), ``pause()``/``resume()`` freeze it with
SIGSTOP/SIGCONT so that clients see a server that accepts connections and never answers.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator

REDIS_SERVER = shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    def __init__(self, directory: str, port: int | None = None) -> None:
        if REDIS_SERVER is None:
            raise RuntimeError("redis-server is not installed (Debian: apt-get install redis-server)")
        self.directory = directory
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        assert REDIS_SERVER is not None and self.proc is None
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.directory, "--daemonize", "no", "--loglevel", "warning", "--databases", "1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while not self.ping():
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode} (port {self.port} taken?)")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer PING within {timeout} s")
            time.sleep(0.01)

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)  # a paused server must be able to die
                proc.kill()
            proc.wait(timeout=10)

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)


@contextlib.contextmanager
def redis_server() -> Iterator[RedisServer]:
    with tempfile.TemporaryDirectory(prefix="askonce-redis-") as directory:
        server = RedisServer(directory)
        server.start()
        try:
            yield server
        finally:
            server.stop()


REDIS_CLI = shutil.which("redis-cli")


def need_cluster_tools() -> str | None:
    """Why a Cluster or Sentinel cannot be started here, or None."""
    if REDIS_SERVER is None:
        return "redis-server is not installed"
    if REDIS_CLI is None:
        return "redis-cli is not installed (it creates the cluster)"
    return None


def free_cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free and valid too."""
    import random

    for _ in range(200):
        port = random.randint(20_000, 45_000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10_000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free pair of loopback ports for a cluster node")


# A replica syncs at once (the default waits 5 s for more replicas to share one transfer).
FAST_SYNC = ["--repl-diskless-sync-delay", "0"]


class Node(RedisServer):
    """A ``redis-server`` started with extra options (cluster mode, replication, sentinel)."""

    def __init__(self, directory: str, extra: list[str], sentinel: bool = False) -> None:
        os.makedirs(directory, exist_ok=True)
        cluster = "--cluster-enabled" in extra
        super().__init__(directory, free_cluster_port() if cluster else None)
        self.extra = list(extra)
        self.sentinel = sentinel

    def start(self, timeout: float = 10.0) -> None:
        assert REDIS_SERVER is not None and self.proc is None
        if self.sentinel:  # sentinel needs a config file it may rewrite
            conf = os.path.join(self.directory, "sentinel.conf")
            with open(conf, "w") as f:
                f.write(f"port {self.port}\nbind 127.0.0.1\ndir {self.directory}\n")
                f.write("\n".join(self.extra) + "\n")
            args = [REDIS_SERVER, conf, "--sentinel"]
        else:
            args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                    "--appendonly", "no", "--dir", self.directory, "--daemonize", "no",
                    "--loglevel", "warning", *self.extra]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while not self.ping():
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer PING within {timeout} s")
            time.sleep(0.01)

    def command(self, *args: str) -> str:
        """One command through redis-cli, its output (for setup only: not on a test's hot path)."""
        assert REDIS_CLI is not None
        out = subprocess.run([REDIS_CLI, "-h", "127.0.0.1", "-p", str(self.port), *args],
                             capture_output=True, text=True, timeout=10, check=True)
        return out.stdout


def wait_until(what: str, check: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


class ClusterSet:
    """A Redis Cluster of 3 masters with one replica each on loopback ports (``node_timeout`` ms:
    how long a silent master takes to be failed over)."""

    def __init__(self, directory: str, node_timeout: int = 1000) -> None:
        self.nodes = [Node(os.path.join(directory, f"n{i}"),
                           ["--cluster-enabled", "yes", "--cluster-node-timeout", str(node_timeout),
                            "--cluster-config-file", "nodes.conf", *FAST_SYNC])
                      for i in range(6)]

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        assert REDIS_CLI is not None
        subprocess.run([REDIS_CLI, "--cluster", "create",
                        *(f"127.0.0.1:{n.port}" for n in self.nodes),
                        "--cluster-replicas", "1", "--cluster-yes"],
                       capture_output=True, timeout=60, check=True)
        wait_until("the cluster to be ok", lambda: all(
            "cluster_state:ok" in n.command("cluster", "info") for n in self.nodes))
        wait_until("every replica to be in sync", lambda: self._roles_known())

    def _roles_known(self) -> bool:
        return sum("master_link_status:up" in n.command("info", "replication")
                   for n in self.nodes) == 3

    def master_of(self, key: str) -> Node:
        """The master that serves ``key``'s slot (as the first live node's CLUSTER NODES says; it
        may be a node that was killed, until the cluster fails it over)."""
        live = [n for n in self.nodes if n.proc is not None]
        slot = int(live[0].command("cluster", "keyslot", key).strip())
        for line in live[0].command("cluster", "nodes").splitlines():
            parts = line.split()
            if "master" not in parts[2] or "fail" in parts[2]:
                continue
            port = int(parts[1].split("@")[0].rpartition(":")[2])
            for r in parts[8:]:
                lo, _, hi = r.partition("-")
                if lo.isdigit() and int(lo) <= slot <= int(hi or lo):
                    return next(n for n in self.nodes if n.port == port)
        raise RuntimeError(f"no master serves {key!r}")

    def failed_over(self, victim: Node, key: str) -> bool:
        """Another node serves ``key``'s slot, and every live node says the cluster is ok."""
        try:
            if self.master_of(key) is victim:
                return False
        except RuntimeError:
            return False
        return all("cluster_state:ok" in n.command("cluster", "info")
                   for n in self.nodes if n.proc is not None)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


class SentinelSet:
    """One master, one replica and one sentinel (quorum 1) on loopback ports; the sentinel fails
    the master over ``down_after`` ms after it stops answering."""

    NAME = "askonce-test"

    def __init__(self, directory: str, down_after: int = 1000) -> None:
        self.master = Node(os.path.join(directory, "m"), FAST_SYNC)
        self.replica = Node(os.path.join(directory, "r"), FAST_SYNC)
        self.replica.extra += ["--replicaof", "127.0.0.1", str(self.master.port)]
        self.sentinel = Node(os.path.join(directory, "s"), [
            f"sentinel monitor {self.NAME} 127.0.0.1 {self.master.port} 1",
            f"sentinel down-after-milliseconds {self.NAME} {down_after}",
            f"sentinel failover-timeout {self.NAME} 5000",
        ], sentinel=True)

    def start(self) -> None:
        self.master.start()
        self.replica.start()
        wait_until("the replica to be in sync",
                   lambda: "master_link_status:up" in self.replica.command("info", "replication"))
        self.sentinel.start()
        wait_until("the sentinel to see the replica", lambda: str(self.replica.port) in
                   self.sentinel.command("sentinel", "replicas", self.NAME))

    def master_port(self) -> int:
        out = self.sentinel.command("sentinel", "get-master-addr-by-name", self.NAME).split()
        return int(out[1])

    def failed_over(self, old: Node) -> bool:
        """The sentinel names another master and its failover is over (no flag but ``master``)."""
        if self.master_port() == old.port:
            return False
        lines = self.sentinel.command("sentinel", "master", self.NAME).splitlines()
        flags = lines[lines.index("flags") + 1] if "flags" in lines else ""
        return flags == "master"

    def stop(self) -> None:
        for node in (self.sentinel, self.replica, self.master):
            node.stop()
