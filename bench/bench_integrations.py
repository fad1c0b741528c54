"""What the ASGI middleware and the httpx transport cost on a loopback hello-world, against bare, same run.

* **ASGI middleware, throughput**: uvicorn servers (one worker each, h11, in processes of their own)
  serve the same raw ASGI hello-world app, bare, wrapped in ``AskonceASGIMiddleware``, and wrapped in a
  do-nothing pure ASGI middleware that adds one constant response header (what any middleware that
  writes a header costs at least). A load generator in this process (asyncio, raw HTTP/1.1 keep-alive,
  ``CONNECTIONS`` connections, each sending its next request when the last response is read) drives one
  server at a time. Every request carries the same ``askonce-question`` header, as a middle layer
  receives it; one case sends none (the middleware then mints, lazily). Figures: requests per second, the
  loss against bare, and the server's CPU time per request over the same window (from ``/proc``): the
  server is the bottleneck, so its CPU per request is what its throughput is, and it does not depend on
  whether the generator, sharing the machine, keeps up. The same pair again with a FastAPI hello-world
  (the middleware added with ``add_middleware``) puts it beside a framework.
* **Peers, for scale**: when installed (``pip install -e '.[bench]'``), the same app behind
  asgi-correlation-id's middleware and OpenTelemetry's ASGI middleware, and a bare client instrumented
  by OpenTelemetry's httpx instrumentation (both with the SDK's tracer, no exporter). Every request carries
  an ``x-request-id`` and a ``traceparent`` besides the question, so that they do their usual work.
* **httpx transport, latency**: sequential GETs over one keep-alive connection to the bare server, with a
  bare ``httpx.Client``, with a bare client that sends a constant ``askonce-question`` (what carrying
  the header costs, on both sides), and with ``AskonceTransport`` (inside a bound question, and with
  nothing bound: a question minted per call). Figures: median latency, the latency added, and this
  thread's CPU per call.

Rounds interleave the cases; each figure is the median over rounds. Targets: under 5 % throughput loss
for the middleware, under 3 % latency added by the transport. ``--pin`` puts the servers on the last CPU
and the generator on the others (steadier on a quiet machine, worse on a busy one).

Timings on a shared machine swing by ten points from run to run. ``--instructions`` gives figures that do
not: the same servers and clients under valgrind's cachegrind, counting the instructions (and simulated
cache misses) per request, a run of 700 requests minus a run of 200. It needs ``valgrind`` and takes
about three minutes on two CPUs. ``--instructions --in-process`` counts the ASGI app called in a loop (no
sockets), with two cases that bound what the middleware's job must cost: ``askonce-free-parse`` (the
middleware with its header parse made free: every other part of its job) and ``essence`` (the least of
the job written as a peer would: find the header, parse it, bind it, write the reply header).
``--profile`` runs both paths in-process under cProfile (no sockets) and prints where their time goes.

    python bench/bench_integrations.py            # markdown table, about 80 s
    python bench/bench_integrations.py --rounds 9 --pin
    python bench/bench_integrations.py --compare /path/to/other/checkout/src   # before/after, same rounds
    python bench/bench_integrations.py --instructions
    python bench/bench_integrations.py --instructions --in-process --compare /path/to/other/checkout/src
    python bench/bench_integrations.py --profile
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import functools
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
ROUNDS = 7
WINDOW = 1.0  # seconds of load per case per round
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


def passthrough(app: Any) -> Any:
    """The least a pure ASGI middleware that writes a response header does: wrap send, add the header."""

    async def middleware(scope: dict[str, Any], receive: Any, send: Any) -> None:
        async def send_(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (b"x-layer", b"bench")]}
            await send(message)

        await app(scope, receive, send_)

    return middleware


def correlation_id(app: Any) -> Any:
    """asgi-correlation-id's middleware: read a request id header, validate it, bind it, write it back."""
    from asgi_correlation_id import CorrelationIdMiddleware

    return CorrelationIdMiddleware(app)


def otel(app: Any) -> Any:
    """OpenTelemetry's ASGI middleware with the SDK's tracer (spans made and ended, no exporter)."""
    from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
    from opentelemetry.sdk.trace import TracerProvider

    return OpenTelemetryMiddleware(app, tracer_provider=TracerProvider())


SERVERS = ("bare", "askonce", "askonce-no-timers", "passthrough", "fastapi", "fastapi+askonce")
# Peers for scale, when installed (``pip install -e '.[bench]'``): what other middlewares cost on the same app.
REFERENCES = {"ref-correlation-id": ("asgi_correlation_id", correlation_id),
              "ref-otel": ("opentelemetry.instrumentation.asgi", otel)}
CLIENT_REFERENCES = {"ref-otel": "opentelemetry.instrumentation.httpx"}
REFERENCE_NAMES = {"ref-correlation-id": "asgi-correlation-id", "ref-otel": "OpenTelemetry (SDK tracer, no exporter)"}


def installed(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def references() -> tuple[str, ...]:
    return tuple(kind for kind, (module, _) in REFERENCES.items() if installed(module))


def client_references() -> tuple[str, ...]:
    return tuple(kind for kind, module in CLIENT_REFERENCES.items() if installed(module))


def otel_client() -> httpx.Client:
    """A bare client instrumented by OpenTelemetry (SDK tracer, no exporter): a span and a traceparent per call."""
    from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor
    from opentelemetry.sdk.trace import TracerProvider

    client = httpx.Client()
    HTTPXClientInstrumentor.instrument_client(client, tracer_provider=TracerProvider())
    return client


def serve(kind: str, pin: bool) -> None:
    """Child process: serve a hello app (bare or wrapped) on a free port; print the port."""
    import uvicorn

    if pin:
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    app: Any = {"bare": lambda: hello, "askonce": lambda: AskonceASGIMiddleware(hello, layer="bench"),
                "askonce-no-timers": lambda: AskonceASGIMiddleware(hello, layer="bench", cancel_on_disconnect=False,
                                                                   shed_deadline=False),
                "passthrough": lambda: passthrough(hello),
                "fastapi": lambda: fastapi_hello(False), "fastapi+askonce": lambda: fastapi_hello(True),
                **{ref: functools.partial(wrap, hello) for ref, (_, wrap) in REFERENCES.items()}}[kind]()
    # IPPROTO_TCP spelled out: asyncio sets TCP_NODELAY only on sockets that say so, and without it the
    # response's two writes (head, body) meet the client's delayed ACK: 40 ms per request.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    print(sock.getsockname()[1], flush=True)
    config = uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False, http="h11", loop="asyncio")
    uvicorn.Server(config).run(sockets=[sock])


class Server:
    def __init__(self, kind: str, pin: bool = False, src: str | None = None) -> None:
        """``src``: serve askonce from this source tree (``PYTHONPATH``) instead of the installed one."""
        self.kind = kind
        env = None if src is None else {**os.environ, "PYTHONPATH": src}
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", kind, *(["--pin"] if pin else [])],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                                     text=True, env=env)
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


# Every request also carries what a middle layer of a traced stack receives beside the question: a request
# id and a W3C traceparent, so that the reference middlewares do their usual work (validate the id, continue
# the trace) and every server, bare included, parses the same bytes.
REQUEST_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def request_bytes(port: int, question: bool) -> bytes:
    head = (f"GET / HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\nuser-agent: bench\r\nx-request-id: {REQUEST_ID}\r\n"
            f"traceparent: {TRACEPARENT}\r\n")
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


async def _load(server: Server, question: bool, seconds: float) -> tuple[int, int, float, float]:
    """Requests, errors, seconds and server CPU seconds of one window (after a warm-up)."""
    request = request_bytes(server.port, question)
    stop, counts = [False], [0, 0]
    tasks = [asyncio.create_task(_connection(server.port, request, stop, counts)) for _ in range(CONNECTIONS)]
    await asyncio.sleep(WARMUP)
    start_count, started, cpu0 = counts[0], time.perf_counter(), server.cpu()
    await asyncio.sleep(seconds)
    done, elapsed, cpu = counts[0] - start_count, time.perf_counter() - started, server.cpu() - cpu0
    stop[0] = True
    await asyncio.gather(*tasks)
    return done, counts[1], elapsed, cpu


def throughput(server: Server, question: bool) -> tuple[float, float]:
    """Requests per second, and the server's CPU microseconds per request, over one window."""
    done, errors, elapsed, cpu = asyncio.run(_load(server, question, WINDOW))
    if errors:
        raise RuntimeError(f"{server.kind}: {errors} responses were not 200")
    return done / elapsed, cpu / done * 1e6


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


def main(pin: bool = False, compare: str | None = None) -> int:
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    refs = references()
    servers = {kind: Server(kind, pin) for kind in (*SERVERS, *refs)}
    if compare is not None:  # the same middleware from another source tree, in the same rounds
        servers.update({f"{kind}@compare": Server(kind, pin, compare) for kind in ("askonce", "fastapi+askonce")})
    if pin:
        os.sched_setaffinity(0, set(range(max(os.sched_getaffinity(0)))) or os.sched_getaffinity(0))
    bare = servers["bare"]
    cases = [("bare", bare, True), ("askonce", servers["askonce"], True),
             ("askonce, none sent", servers["askonce"], False),
             ("askonce, no timers (no cancellation)", servers["askonce-no-timers"], True),
             ("pass-through middleware adding a header", servers["passthrough"], True),
             *((f"reference: {REFERENCE_NAMES[ref]}", servers[ref], True) for ref in refs),
             ("FastAPI", servers["fastapi"], True),
             ("FastAPI + askonce", servers["fastapi+askonce"], True)]
    if compare is not None:
        cases[2:2] = [(f"askonce from {compare}", servers["askonce@compare"], True)]
        cases.append((f"FastAPI + askonce from {compare}", servers["fastapi+askonce@compare"], True))
    rps: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    cpu: dict[str, list[float]] = {k: [] for k in rps}
    url = f"http://127.0.0.1:{bare.port}/"
    clients = {
        "bare": (httpx.Client(), False),
        "bare, sending a constant askonce-question": (httpx.Client(headers={"askonce-question": QUESTION}), False),
        "askonce, bound": (httpx.Client(transport=AskonceTransport(policy=POLICY)), True),
        "askonce, minted": (httpx.Client(transport=AskonceTransport(policy=POLICY)), False),
        **{f"reference: {REFERENCE_NAMES[ref]}": (otel_client(), False) for ref in client_references()},
    }
    lat: dict[str, list[float]] = {k: [] for k in clients}
    ccpu: dict[str, list[float]] = {k: [] for k in clients}
    try:
        for client, bound in clients.values():  # warm the connections and the code paths
            latencies(client, url, bound)
        for _ in range(ROUNDS):
            for name, server, question in cases:
                with no_gc():
                    r, c = throughput(server, question)
                rps[name].append(r)
                cpu[name].append(c)
            for name, (client, bound) in clients.items():
                with no_gc():
                    latency, c = latencies(client, url, bound)
                lat[name].append(latency)
                ccpu[name].append(c)
    finally:
        for client, _ in clients.values():
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
          f"{os.cpu_count()} CPUs{', pinned' if pin else ''}, load average {load_before:.2f} -> {load_after:.2f}; "
          f"uvicorn (h11) one worker per server; {CONNECTIONS} keep-alive connections; medians of {ROUNDS} "
          f"interleaved rounds ({WINDOW:.1f} s per case per round; {LATENCY_CALLS} sequential calls per latency "
          f"case); {time.monotonic() - started:.0f} s.\n")
    print("| ASGI server | requests/s | vs bare | server CPU per request | vs bare |")
    print("|---|---:|---:|---:|---:|")
    for k in rps:
        base = "FastAPI" if k.startswith("FastAPI") else "bare"
        extra = "" if k == base else f"{pct(mcpu[k], mcpu[base])} ({mcpu[k] - mcpu[base]:+.1f} us)"
        print(f"| {k} | {med[k]:,.0f} | {pct(med[k], med[base]) if k != base else ''} | {mcpu[k]:.1f} us | {extra} |")
    print("\n| httpx client | median latency | added | client CPU per call | added |")
    print("|---|---:|---:|---:|---:|")
    for k in lat:
        extra = "" if k == "bare" else f"{mccpu[k] - mccpu['bare']:+.1f} us"
        print(f"| {k} | {mlat[k]:.0f} us | {pct(mlat[k], mlat['bare']) if k != 'bare' else ''} | "
              f"{mccpu[k]:.0f} us | {extra} |")
    loss = (mcpu["askonce"] - mcpu["bare"]) / mcpu["askonce"] * 100
    fastapi_loss = (mcpu["FastAPI + askonce"] - mcpu["FastAPI"]) / mcpu["FastAPI + askonce"] * 100
    added = (mlat["askonce, bound"] - mlat["bare"]) / mlat["bare"] * 100
    print(f"\nThroughput loss implied by server CPU per request (1 - bare/askonce): {loss:.1f} % on a raw ASGI "
          f"app, {fastapi_loss:.1f} % on FastAPI (target < {TARGET_ASGI_LOSS:.0f} %: "
          f"{'met' if loss < TARGET_ASGI_LOSS else 'missed'}); httpx latency added {added:.1f} % (target < "
          f"{TARGET_HTTPX_ADDED:.0f} %: {'met' if added < TARGET_HTTPX_ADDED else 'missed'}). Requests per "
          f"second swing with whatever else the machine runs; CPU per request is the steadier figure.")
    return 0


# --- instructions per request, under valgrind: the same figures on a busy machine as on a quiet one -------

VALGRIND = ("valgrind", "--tool=cachegrind", "--cache-sim=yes", "--cachegrind-out-file=/dev/null")
_CG_FIELDS = {"I refs": "ir", "I1 misses": "i1", "LLi misses": "lli", "D1 misses": "d1", "LLd misses": "lld"}


def _cachegrind(stderr: str) -> dict[str, int]:
    out = {}
    for line in stderr.splitlines():
        label, colon, value = " ".join(line.split("==", 2)[-1].split()).partition(":")
        if colon and label in _CG_FIELDS and value.split():
            out[_CG_FIELDS[label]] = int(value.split()[0].replace(",", ""))
    if len(out) != len(_CG_FIELDS):
        raise RuntimeError(f"no cachegrind summary in:\n{stderr[-2000:]}")
    return out


async def _count(port: int, n: int) -> None:
    """Exactly ``n`` requests over CONNECTIONS keep-alive connections."""
    request, left = request_bytes(port, True), [n]

    async def one() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while left[0] > 0:
            left[0] -= 1
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(line[15:]) for line in head.split(b"\r\n") if line[:15].lower() == b"content-length:")
            await reader.readexactly(length)
        writer.close()

    await asyncio.gather(*(one() for _ in range(CONNECTIONS)))


def _server_run(kind: str, n: int, src: str | None = None) -> dict[str, int]:
    env = None if src is None else {**os.environ, "PYTHONPATH": src}
    proc = subprocess.Popen([*VALGRIND, sys.executable, __file__, "--serve", kind], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env)
    assert proc.stdout is not None
    port = int(proc.stdout.readline())
    for _ in range(600):  # uvicorn under valgrind takes seconds to start listening
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            break
        time.sleep(0.1)
    asyncio.run(_count(port, n))
    proc.send_signal(2)  # SIGINT: uvicorn exits cleanly and valgrind writes its summary
    return _cachegrind(proc.communicate(timeout=600)[1])


def client_calls(kind: str, n: int, url: str) -> None:
    """Child process: ``n`` sequential GETs with one of the latency cases' clients."""
    client = {"bare": lambda: httpx.Client(), "ref-otel": otel_client,
              "header": lambda: httpx.Client(headers={"askonce-question": QUESTION}),
              "bound": lambda: httpx.Client(transport=AskonceTransport(policy=POLICY)),
              "minted": lambda: httpx.Client(transport=AskonceTransport(policy=POLICY))}[kind]()
    with askonce.question(budget=2, deadline=600.0) if kind == "bound" else contextlib.nullcontext(), client:
        for _ in range(n):
            client.get(url).raise_for_status()


def _client_run(kind: str, url: str, n: int) -> dict[str, int]:
    done = subprocess.run([*VALGRIND, sys.executable, __file__, "--client", kind, str(n), url], capture_output=True,
                          text=True, timeout=600, check=True)
    return _cachegrind(done.stderr)


def instructions(small: int = 200, large: int = 700, compare: str | None = None,
                 kinds: list[str] | None = None) -> int:
    """Instructions (and simulated cache misses) per request: a run of ``large`` minus one of ``small``.

    ``compare``: also the askonce servers with askonce from this source tree (rows ``<kind>@compare``);
    ``kinds``: only these cases (``server:bare``, ``client:bound``, ...; default all)."""
    from concurrent.futures import ThreadPoolExecutor

    started = time.monotonic()
    bare = Server("bare")
    url = f"http://127.0.0.1:{bare.port}/"
    jobs = {**{("server", k): functools.partial(_server_run, k) for k in (*SERVERS, *references())},
            **{("server", f"{k}@compare"): functools.partial(_server_run, k, src=compare)
               for k in SERVERS if "askonce" in k and compare is not None},
            **{("client", k): functools.partial(_client_run, k, url)
               for k in ("bare", "header", "bound", "minted", *client_references())}}
    if kinds:
        jobs = {job: run for job, run in jobs.items()
                if f"{job[0]}:{job[1]}" in kinds or f"{job[0]}:{job[1].split('@')[0]}" in kinds}
    try:
        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            runs = {(job, n): pool.submit(run, n) for job, run in jobs.items() for n in (small, large)}
            per = {job: {m: (runs[(job, large)].result()[m] - runs[(job, small)].result()[m]) / (large - small)
                         for m in _CG_FIELDS.values()} for job in jobs}
    finally:
        bare.close()
    # cachegrind's rough cycle estimate: a first-level miss ~10 instructions' time, a last-level one ~100
    est = {job: v["ir"] + 10 * (v["i1"] + v["d1"]) + 100 * (v["lli"] + v["lld"]) for job, v in per.items()}
    print("## Instructions per request (valgrind cachegrind), ASGI servers and httpx clients\n")
    print(f"{datetime.date.today().isoformat()}, Python {platform.python_version()}, {platform.machine()}; per "
          f"request: a run of {large} requests minus a run of {small}; {time.monotonic() - started:.0f} s. "
          f"Estimated cycles = instructions + 10 x first-level misses + 100 x last-level misses.\n")
    print("| process | instructions | vs base | est. cycles | vs base |\n|---|---:|---:|---:|---:|")
    for (side, kind), v in per.items():
        base = (side, "fastapi" if kind.startswith("fastapi") else "bare")
        if base not in per:
            base = (side, kind)
        same = (side, kind) == base
        print(f"| {side}: {kind} | {v['ir']:,.0f} | {'' if same else pct(v['ir'], per[base]['ir'])} | "
              f"{est[(side, kind)]:,.0f} | {'' if same else pct(est[(side, kind)], est[base])} |")
    return 0


def free_parse(**options: Any) -> Any:
    """The middleware with the header's parse made free: ``wire.parse_frame`` swapped for a function that
    returns the same question's frame without reading the header (a fresh ``Tab`` and ``Account`` per call,
    as the parse makes). What every other part of the middleware's job costs: a floor for any parser."""
    from askonce.core.question import Account, Tab

    parsed = wire.parse_frame(QUESTION.encode(), 0.0)
    assert type(parsed) is tuple, parsed
    tab, path = parsed
    key, origin, edge, deadline = tab.key, tab.origin, tab.edge, tab.deadline or 0.0

    def parse_frame(text: Any, now: float, limits: Any = None) -> Any:
        return Tab(key, origin, edge, Account(2), now + deadline, None, None), path

    wire.parse_frame = parse_frame  # the server calls it as wire.parse_frame
    return AskonceASGIMiddleware(hello, layer="bench", **options)


def essence(app: Any) -> Any:
    """The least of the middleware's job, written as a peer would: find the header, parse it with askonce's
    parser, bind the frame for the request, wrap send and write the reply header with the budget left. No
    ledger hook, trust, deadline, disconnect watch, give-up record, 503 or error handling."""
    from askonce._context import FRAME

    replies = [wire.format_reply(wire.Reply(left)).encode() for left in range(65)]

    async def middleware(scope: dict[str, Any], receive: Any, send: Any) -> None:
        frame = None
        for k, v in scope["headers"]:
            if k == b"askonce-question":
                parsed = wire.parse_frame(v, time.monotonic())
                if type(parsed) is tuple:
                    frame = parsed
        if frame is None:
            await app(scope, receive, send)
            return
        account = frame[0].account

        async def send_(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (b"askonce-reply", replies[account.left])]}
            await send(message)

        token = FRAME.set(frame)
        try:
            await app(scope, receive, send_)
        finally:
            FRAME.reset(token)

    return middleware


INPROCESS = {"bare": lambda: hello, "passthrough": lambda: passthrough(hello),
             "askonce-free-parse": free_parse,
             "askonce-no-timers-free-parse": lambda: free_parse(cancel_on_disconnect=False,
                                                                shed_deadline=False),
             "essence": lambda: essence(hello),
             "askonce": lambda: AskonceASGIMiddleware(hello, layer="bench"),
             "askonce-no-timers": lambda: AskonceASGIMiddleware(hello, layer="bench", cancel_on_disconnect=False,
                                                                shed_deadline=False),
             **{ref: functools.partial(wrap, hello) for ref, (_, wrap) in REFERENCES.items()}}


def asgi_loop(kind: str, n: int) -> None:
    """Child process: ``n`` in-process calls of one ASGI app (no sockets), as ``--profile`` makes them."""
    app = INPROCESS[kind]()
    scope = {"type": "http", "method": "GET", "path": "/", "http_version": "1.1", "scheme": "http",
             "query_string": b"", "root_path": "", "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 50000),
             "headers": [(b"host", b"127.0.0.1:8000"), (b"user-agent", b"bench"),
                         (b"x-request-id", REQUEST_ID.encode()), (b"traceparent", TRACEPARENT.encode()),
                         (b"askonce-question", QUESTION.encode())]}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    async def send(message: Any) -> None:
        return None

    async def calls() -> None:
        for _ in range(n):
            await app(scope, receive, send)

    asyncio.run(calls())


def instructions_in_process(small: int = 200, large: int = 2200, compare: str | None = None) -> int:
    """Instructions per in-process ASGI call (cachegrind, ``large`` calls minus ``small``), peers beside."""
    from concurrent.futures import ThreadPoolExecutor

    def run(kind: str, n: int, src: str | None) -> int:
        env = None if src is None else {**os.environ, "PYTHONPATH": src}
        done = subprocess.run([*VALGRIND, sys.executable, __file__, "--asgi-loop", kind, str(n)], capture_output=True,
                              text=True, timeout=600, check=True, env=env)
        return _cachegrind(done.stderr)["ir"]

    kinds = [(k, None) for k in INPROCESS if not k.startswith("ref-") or k in references()]
    kinds += [(k, compare) for k in ("askonce", "askonce-no-timers") if compare is not None]
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        runs = {(k, src, n): pool.submit(run, k, n, src) for k, src in kinds for n in (small, large)}
        per = {(k, src): (runs[(k, src, large)].result() - runs[(k, src, small)].result()) / (large - small)
               for k, src in kinds}
    bare = per[("bare", None)]
    print(f"| in-process ASGI call ({large} minus {small}) | instructions | over bare |\n|---|---:|---:|")
    for (k, src), v in per.items():
        name, over = k if src is None else f"{k} from {src}", "" if k == "bare" else f"{v - bare:+,.0f}"
        print(f"| {name} | {v:,.0f} | {over} |")
    return 0


# --- where the time goes --------------------------------------------------------------------------------


def profile(n: int = 20_000) -> None:
    """Both paths in-process under cProfile: the middleware called as ASGI, the transport on a stub."""
    import cProfile
    import pstats

    mw = AskonceASGIMiddleware(hello, layer="bench")
    scope = {"type": "http", "method": "GET", "path": "/", "http_version": "1.1", "scheme": "http", "query_string": b"",
             "root_path": "", "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 50000),
             "headers": [(b"x-request-id", REQUEST_ID.encode()), (b"traceparent", TRACEPARENT.encode()),
                         (b"askonce-question", QUESTION.encode())]}

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
        ("middleware, no question sent", mw, scope["headers"][:-1]),
        ("middleware, cancel_on_disconnect=False", AskonceASGIMiddleware(hello, layer="bench",
                                                                        cancel_on_disconnect=False), scope["headers"]),
        ("... and shed_deadline=False", AskonceASGIMiddleware(hello, layer="bench", cancel_on_disconnect=False,
                                                              shed_deadline=False), scope["headers"]),
        ("pass-through middleware adding a header", passthrough(hello), scope["headers"]),
        ("the job's essence (find, parse, bind, reply)", essence(hello), scope["headers"]),
        *((f"reference: {REFERENCE_NAMES[ref]}", REFERENCES[ref][1](hello), scope["headers"]) for ref in references())]

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
    ap.add_argument("--serve", choices=(*SERVERS, *REFERENCES), help=argparse.SUPPRESS)
    ap.add_argument("--profile", action="store_true", help="print where the time of both paths goes")
    ap.add_argument("--rounds", type=int, default=ROUNDS, help=f"interleaved rounds (default {ROUNDS})")
    ap.add_argument("--pin", action="store_true", help="servers on the last CPU, the load generator on the others")
    ap.add_argument("--instructions", action="store_true", help="instructions per request under valgrind")
    ap.add_argument("--compare", metavar="SRC", help="also serve the middleware from this source tree (e.g. a "
                    "checkout's src/), interleaved in the same rounds: before/after under the same noise")
    ap.add_argument("--kinds", metavar="LIST", help="with --instructions: only these cases, e.g. "
                    "server:bare,server:askonce,server:ref-correlation-id")
    ap.add_argument("--in-process", action="store_true", help="with --instructions: in-process ASGI calls "
                    "(no sockets) instead of the loopback servers")
    ap.add_argument("--asgi-loop", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--client", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    ROUNDS = args.rounds
    if args.serve:
        serve(args.serve, args.pin)
    elif args.client:
        client_calls(args.client[0], int(args.client[1]), args.client[2])
    elif args.asgi_loop:
        asgi_loop(args.asgi_loop[0], int(args.asgi_loop[1]))
    elif args.instructions and args.in_process:
        sys.exit(instructions_in_process(compare=args.compare))
    elif args.instructions:
        sys.exit(instructions(compare=args.compare, kinds=args.kinds.split(",") if args.kinds else None))
    elif args.profile:
        profile()
    else:
        sys.exit(main(args.pin, args.compare))
