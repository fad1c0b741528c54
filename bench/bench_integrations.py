"""What the ASGI middleware and the httpx transport cost on a loopback hello-world, against bare, same run.

* **ASGI middleware, throughput**: two uvicorn servers (one worker each, h11, in processes of their own)
  serve the same raw ASGI hello-world app, one wrapped in ``AskonceASGIMiddleware``. A load generator in
  this process (asyncio, raw HTTP/1.1 keep-alive, ``CONNECTIONS`` connections, each sending its next
  request when the last response is read) drives one server at a time. Every request carries the same
  ``askonce-question`` header, as a middle layer receives it; a third case sends none (the middleware
  then mints, lazily). Figures: requests per second, the loss against bare, and the server's CPU time per
  request (from ``/proc``), which does not depend on whether the generator keeps up. The same pair again
  with a FastAPI hello-world (the middleware added with ``add_middleware``) puts it beside a framework.
* **httpx transport, latency**: sequential GETs over one keep-alive connection to the bare server, with a
  bare ``httpx.Client`` and with ``AskonceTransport`` (inside a bound question, and with nothing bound: a
  question minted per call). Figures: median latency, the latency added, and this thread's CPU per call.

Rounds interleave the cases; each figure is the median over rounds. Targets: under 5 % throughput loss
for the middleware, under 3 % latency added by the transport. ``--profile`` runs both paths in-process
under cProfile (no sockets) and prints where their time goes.

    python bench/bench_integrations.py            # markdown table, about 60 s
    python bench/bench_integrations.py --profile
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import gc
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx

import askonce
from askonce import RetryPolicy
from askonce.client import ClientPolicy
from askonce.core import wire
from askonce.core.question import Hop, mint_key
from askonce.integrations.asgi import AskonceASGIMiddleware
from askonce.integrations.httpx import AskonceTransport

CONNECTIONS = 16
ROUNDS = 5
WINDOW = 1.5  # seconds of load per case per round
WARMUP = 0.3
LATENCY_CALLS = 400  # sequential calls per case per round
TARGET_ASGI_LOSS = 5.0
TARGET_HTTPX_ADDED = 3.0
BODY = b"hello, world\n"
QUESTION = wire.format_question(mint_key(1_700_000_000_000, bytes(range(16))), "edge", True, 2, 2.5,
                                (Hop("edge", 1), Hop("gateway", 1)))
POLICY = ClientPolicy(layer="bench", retry=RetryPolicy(attempts=3), bucket=None)


# --- the servers ----------------------------------------------------------------------------------------


async def hello(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(BODY)).encode())]})
    await send({"type": "http.response.body", "body": BODY})


def fastapi_hello(with_askonce: bool) -> Any:
    from fastapi import FastAPI
    from fastapi.responses import PlainTextResponse

    app = FastAPI()

    @app.get("/")
    async def root() -> PlainTextResponse:
        return PlainTextResponse(BODY)

    if with_askonce:
        app.add_middleware(AskonceASGIMiddleware, layer="bench")
    return app


SERVERS = ("bare", "askonce", "askonce-no-timers", "fastapi", "fastapi+askonce")


def serve(kind: str) -> None:
    """Child process: serve a hello app (bare or wrapped) on a free port; print the port."""
    import uvicorn

    app: Any = {"bare": lambda: hello, "askonce": lambda: AskonceASGIMiddleware(hello, layer="bench"),
                "askonce-no-timers": lambda: AskonceASGIMiddleware(hello, layer="bench", cancel_on_disconnect=False,
                                                                   shed_deadline=False),
                "fastapi": lambda: fastapi_hello(False), "fastapi+askonce": lambda: fastapi_hello(True)}[kind]()
    # IPPROTO_TCP spelled out: asyncio sets TCP_NODELAY only on sockets that say so, and without it the
    # response's two writes (head, body) meet the client's delayed ACK: 40 ms per request.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    print(sock.getsockname()[1], flush=True)
    config = uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False, http="h11", loop="asyncio")
    uvicorn.Server(config).run(sockets=[sock])


class Server:
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", kind], stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True)
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())
        deadline = time.monotonic() + 10
        while True:  # uvicorn listens on the socket only once it has started
            try:
                httpx.get(f"http://127.0.0.1:{self.port}/", timeout=1.0).raise_for_status()
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def cpu(self) -> float:
        """User + system CPU seconds of the server process so far."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


# --- the load generator ---------------------------------------------------------------------------------


def request_bytes(port: int, question: bool) -> bytes:
    head = f"GET / HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\nuser-agent: bench\r\n"
    if question:
        head += f"askonce-question: {QUESTION}\r\n"
    return (head + "\r\n").encode()


async def _connection(port: int, request: bytes, stop: list[bool], counts: list[int]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while not stop[0]:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                counts[1] += 1
            length = 0
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            await reader.readexactly(length)
            counts[0] += 1
    finally:
        writer.close()


async def _load(port: int, question: bool, seconds: float) -> tuple[int, int, float]:
    request = request_bytes(port, question)
    stop, counts = [False], [0, 0]
    tasks = [asyncio.create_task(_connection(port, request, stop, counts)) for _ in range(CONNECTIONS)]
    await asyncio.sleep(WARMUP)
    start_count, started = counts[0], time.perf_counter()
    await asyncio.sleep(seconds)
    done, elapsed = counts[0] - start_count, time.perf_counter() - started
    stop[0] = True
    await asyncio.gather(*tasks)
    return done, counts[1], elapsed


def throughput(server: Server, question: bool) -> tuple[float, float]:
    """Requests per second, and the server's CPU microseconds per request, over one window."""
    cpu0 = server.cpu()
    done, errors, elapsed = asyncio.run(_load(server.port, question, WINDOW))
    cpu = server.cpu() - cpu0
    if errors:
        raise RuntimeError(f"{server.kind}: {errors} responses were not 200")
    return done / elapsed, cpu / (done + CONNECTIONS) * 1e6  # the warm-up's requests are in the CPU too (close)


# --- the httpx latency ----------------------------------------------------------------------------------


def latencies(client: httpx.Client, url: str, bound: bool) -> tuple[float, float]:
    """Median latency (us) of LATENCY_CALLS sequential calls, and this thread's CPU (us) per call."""
    samples = []
    ctx = askonce.question(budget=2, deadline=60.0) if bound else contextlib.nullcontext()
    with ctx:
        cpu0 = time.thread_time_ns()
        for _ in range(LATENCY_CALLS):
            t0 = time.perf_counter_ns()
            r = client.get(url)
            samples.append(time.perf_counter_ns() - t0)
            if r.status_code != 200 or r.content != BODY:
                raise RuntimeError(f"unexpected answer {r.status_code}")
        cpu = time.thread_time_ns() - cpu0
    return statistics.median(samples) / 1000, cpu / LATENCY_CALLS / 1000


# --- the run --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def pct(x: float, base: float) -> str:
    return f"{(x - base) / base * 100:+.1f} %"


def main() -> int:
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    servers = {kind: Server(kind) for kind in SERVERS}
    bare = servers["bare"]
    cases = [("bare", bare, True), ("askonce", servers["askonce"], True),
             ("askonce, none sent", servers["askonce"], False),
             ("askonce, no timers (no cancellation)", servers["askonce-no-timers"], True),
             ("FastAPI", servers["fastapi"], True),
             ("FastAPI + askonce", servers["fastapi+askonce"], True)]
    rps: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    cpu: dict[str, list[float]] = {k: [] for k in rps}
    lat: dict[str, list[float]] = {"bare": [], "askonce, bound": [], "askonce, minted": []}
    ccpu: dict[str, list[float]] = {k: [] for k in lat}
    url = f"http://127.0.0.1:{bare.port}/"
    clients = {
        "bare": httpx.Client(),
        "askonce, bound": httpx.Client(transport=AskonceTransport(policy=POLICY)),
        "askonce, minted": httpx.Client(transport=AskonceTransport(policy=POLICY)),
    }
    try:
        for name, c in clients.items():  # warm the connections and the code paths
            latencies(c, url, name.endswith("bound"))
        for _ in range(ROUNDS):
            for name, server, question in cases:
                with no_gc():
                    r, c = throughput(server, question)
                rps[name].append(r)
                cpu[name].append(c)
            for name, client in clients.items():
                with no_gc():
                    latency, c = latencies(client, url, name.endswith("bound"))
                lat[name].append(latency)
                ccpu[name].append(c)
    finally:
        for client in clients.values():
            client.close()
        for server in servers.values():
            server.close()
    load_after = os.getloadavg()[0]

    med = {k: statistics.median(v) for k, v in rps.items()}
    mcpu = {k: statistics.median(v) for k, v in cpu.items()}
    mlat = {k: statistics.median(v) for k, v in lat.items()}
    mccpu = {k: statistics.median(v) for k, v in ccpu.items()}
    print("## Integration overhead: ASGI middleware and httpx transport on a loopback hello-world\n")
    print(f"{datetime.date.today().isoformat()}, Python {platform.python_version()}, {platform.machine()}, "
          f"{os.cpu_count()} CPUs, load average {load_before:.2f} -> {load_after:.2f}; uvicorn (h11) one worker "
          f"per server; {CONNECTIONS} keep-alive connections; medians of {ROUNDS} interleaved rounds "
          f"({WINDOW:.1f} s per case per round; {LATENCY_CALLS} sequential calls per latency case); "
          f"{time.monotonic() - started:.0f} s.\n")
    print("| ASGI server | requests/s | vs bare | server CPU per request | vs bare |")
    print("|---|---:|---:|---:|---:|")
    for k in rps:
        base = "FastAPI" if k.startswith("FastAPI") else "bare"
        print(f"| {k} | {med[k]:,.0f} | {pct(med[k], med[base]) if k != base else ''} | "
              f"{mcpu[k]:.0f} us | {pct(mcpu[k], mcpu[base]) if k != base else ''} |")
    print("\n| httpx client | median latency | added | client CPU per call | added |")
    print("|---|---:|---:|---:|---:|")
    for k in lat:
        extra = "" if k == "bare" else f"+{mccpu[k] - mccpu['bare']:.1f} us"
        print(f"| {k} | {mlat[k]:.0f} us | {pct(mlat[k], mlat['bare']) if k != 'bare' else ''} | "
              f"{mccpu[k]:.0f} us | {extra} |")
    loss = (med["bare"] - med["askonce"]) / med["bare"] * 100
    fastapi_loss = (med["FastAPI"] - med["FastAPI + askonce"]) / med["FastAPI"] * 100
    added = (mlat["askonce, bound"] - mlat["bare"]) / mlat["bare"] * 100
    print(f"\nASGI throughput loss {loss:.1f} % on a raw ASGI app, {fastapi_loss:.1f} % on FastAPI (target < "
          f"{TARGET_ASGI_LOSS:.0f} %: {'met' if loss < TARGET_ASGI_LOSS else 'missed'}); httpx latency added "
          f"{added:.1f} % (target < {TARGET_HTTPX_ADDED:.0f} %: "
          f"{'met' if added < TARGET_HTTPX_ADDED else 'missed'}). Server CPU per request includes the "
          f"load generator's warm-up requests; compare rows, not absolute values.")
    return 0


# --- where the time goes --------------------------------------------------------------------------------


def profile(n: int = 20_000) -> None:
    """Both paths in-process under cProfile: the middleware called as ASGI, the transport on a stub."""
    import cProfile
    import pstats

    mw = AskonceASGIMiddleware(hello, layer="bench")
    scope = {"type": "http", "method": "GET", "path": "/", "headers": [(b"askonce-question", QUESTION.encode())]}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    async def send(message: Any) -> None:
        return None

    async def asgi_calls() -> None:
        for _ in range(n):
            await mw(scope, receive, send)

    class Stub(httpx.BaseTransport):
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            return httpx.Response(200, headers={"askonce-reply": "v=1, b=2"}, content=BODY)

    client = httpx.Client(transport=AskonceTransport(Stub(), policy=POLICY))

    def httpx_calls() -> None:
        with askonce.question(budget=2, deadline=60.0):
            for _ in range(n):
                client.get("http://stub/")

    # Without the profiler: microseconds per request in-process, and what each part of the middleware costs.
    async def per_call(app: Any, headers: list[tuple[bytes, bytes]]) -> float:
        s = {**scope, "headers": headers}
        t0 = time.perf_counter_ns()
        for _ in range(n // 4):
            await app(s, receive, send)
        return (time.perf_counter_ns() - t0) / (n // 4) / 1000

    variants: list[tuple[str, Any, list[tuple[bytes, bytes]]]] = [
        ("bare app", hello, scope["headers"]), ("middleware", mw, scope["headers"]),
        ("middleware, no question sent", mw, []),
        ("middleware, cancel_on_disconnect=False", AskonceASGIMiddleware(hello, layer="bench",
                                                                        cancel_on_disconnect=False), scope["headers"]),
        ("... and shed_deadline=False", AskonceASGIMiddleware(hello, layer="bench", cancel_on_disconnect=False,
                                                              shed_deadline=False), scope["headers"])]

    async def table() -> dict[str, list[float]]:
        out: dict[str, list[float]] = {name: [] for name, _, _ in variants}
        for _ in range(5):
            for name, app, headers in variants:
                with no_gc():
                    out[name].append(await per_call(app, headers))
        return out

    print("\n| in-process, no sockets | us per request |\n|---|---:|")
    for name, values in asyncio.run(table()).items():
        print(f"| {name} | {statistics.median(values):.1f} |")
    plain = httpx.Client(transport=Stub())

    def client_calls(c: httpx.Client) -> float:
        t0 = time.perf_counter_ns()
        for _ in range(n // 4):
            c.get("http://stub/")
        return (time.perf_counter_ns() - t0) / (n // 4) / 1000

    rows: dict[str, list[float]] = {"httpx, bare (stub transport)": [], "httpx + AskonceTransport, bound": []}
    for _ in range(5):
        with no_gc():
            rows["httpx, bare (stub transport)"].append(client_calls(plain))
            with askonce.question(budget=2, deadline=60.0):
                rows["httpx + AskonceTransport, bound"].append(client_calls(client))
    for name, values in rows.items():
        print(f"| {name} | {statistics.median(values):.1f} |")

    for label, run in (("ASGI middleware", lambda: asyncio.run(asgi_calls())), ("httpx transport", httpx_calls)):
        prof = cProfile.Profile()
        prof.enable()
        run()
        prof.disable()
        print(f"\n### {label}: {n} calls, top 15 by own time\n\n```")
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(15)
        print("```")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--serve", choices=SERVERS, help=argparse.SUPPRESS)
    ap.add_argument("--profile", action="store_true", help="print where the time of both paths goes")
    args = ap.parse_args()
    if args.serve:
        serve(args.serve)
    elif args.profile:
        profile()
    else:
        sys.exit(main())
