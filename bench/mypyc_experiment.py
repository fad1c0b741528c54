"""An experiment, not a build: what compiling the server's hot path with mypyc would save.

It copies ``src/`` to a temporary directory, makes the few source changes mypyc needs there (a ``str``
subclass and the weakly referenced request object kept as plain Python classes, one variable renamed,
one chained class attribute split), compiles the modules a request goes through, and then times the
same ASGI middleware in-process against the pure tree, in separate interpreters, interleaved:

    python bench/mypyc_experiment.py             # about 2 minutes (the build is most of it); needs gcc
    python bench/mypyc_experiment.py --tests     # also runs a sample of the test suite on the compiled tree

Figures: microseconds per request of the bare app and of the middleware, the middleware's own cost
(the difference), and ``parse_frame``. Nothing here is shipped: askonce is pure Python
(docs/integrations.md, "Against other middlewares, and a compiled build", says why).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODULES = ["askonce/core/wire.py", "askonce/core/question.py", "askonce/propagation.py", "askonce/client/__init__.py",
           "askonce/integrations/_server.py", "askonce/integrations/asgi.py"]
# What mypyc refuses in the pure source, changed in the copy only.
PLAIN_CLASS = "\nfrom mypy_extensions import mypyc_attr\n\n\n@mypyc_attr(native_class=False)"
FLAGS = ["started", "completed", "running", "gone", "only_ours", "reading", "deferred", "watching", "timing"]
EDITS = {
    "askonce/core/wire.py": [
        ("\nclass Token(str):", PLAIN_CLASS + "\nclass Token(str):"),  # mypyc compiles no str subclass
        ("    most = limits.max_budget\n    return key, origin, edge is not None, most if most < budget",
         "    most_b = limits.max_budget\n    return key, origin, edge is not None, most_b if most_b < budget"),
    ],
    "askonce/integrations/asgi.py": [
        ("\nclass _Exchange:", PLAIN_CLASS + "\nclass _Exchange:"),  # native classes cannot be weakly referenced
        (f"    {' = '.join(FLAGS)} = False\n", "".join(f"    {name}: bool = False\n" for name in FLAGS)),
    ],
}
SETUP = """from setuptools import setup
from mypyc.build import mypycify
setup(name="askonce_mypyc_experiment", packages=[], ext_modules=mypycify({modules!r}, opt_level="3"))
"""
# Run in a fresh interpreter per tree: the middleware's own cost per request, and parse_frame.
PROBE = r"""
import asyncio, gc, statistics, sys, time, timeit
sys.path.insert(0, {bench!r})
import askonce.core.wire as wire
from bench_integrations import QUESTION, hello
from askonce.integrations.asgi import AskonceASGIMiddleware
compiled = wire.__file__.endswith(".so")
app = AskonceASGIMiddleware(hello, layer="bench")
scope = {{"type": "http", "method": "GET", "path": "/",
         "headers": [(b"host", b"x"), (b"askonce-question", QUESTION.encode())]}}
async def receive(): return {{"type": "http.request", "body": b""}}
async def send(message): return None
async def per_request(target):
    gc.disable(); t0 = time.thread_time_ns()
    for _ in range(5000): await target(scope, receive, send)
    t = (time.thread_time_ns() - t0) / 5000 / 1000; gc.enable(); return t
async def main():
    for _ in range(500): await app(scope, receive, send)
    bare, mw = [], []
    for _ in range(7):
        bare.append(await per_request(hello)); mw.append(await per_request(app))
    return statistics.median(bare), statistics.median(mw)
bare, mw = asyncio.run(main())
q, lim = QUESTION.encode(), wire.Limits()
parse = min(timeit.repeat(lambda: wire.parse_frame(q, 1000.0, lim), number=20000, repeat=5)) / 20000 * 1e6
print(compiled, bare, mw, parse)
"""
TESTS = ["tests/core/test_wire.py", "tests/core/test_wire_caches.py", "tests/integrations/test_asgi.py",
         "tests/client/test_caller.py", "tests/integrations/test_wsgi.py", "tests/integrations/test_httpx.py",
         "tests/integrations/test_requests.py", "tests/client/test_exports.py"]


def build(tree: Path) -> None:
    for module, edits in EDITS.items():
        path = tree / module
        text = path.read_text()
        for old, new in edits:
            if old not in text:
                raise SystemExit(f"{module}: the source changed; update EDITS ({old[:40]!r}...)")
            text = text.replace(old, new, 1)
        path.write_text(text)
    (tree / "setup.py").write_text(SETUP.format(modules=MODULES))
    subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tree, check=True,
                   stdout=subprocess.DEVNULL)


def probe(src: Path) -> tuple[bool, float, float, float]:
    out = subprocess.run([sys.executable, "-c", PROBE.format(bench=str(ROOT / "bench"))], check=True,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(src)}).stdout
    compiled, bare, mw, parse = out.split()
    return compiled == "True", float(bare), float(mw), float(parse)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--tests", action="store_true", help="run a sample of the tests on the compiled tree")
    ap.add_argument("--rounds", type=int, default=3, help="interpreters per tree, interleaved (default 3)")
    args = ap.parse_args()
    if shutil.which("gcc") is None and shutil.which("cc") is None:
        raise SystemExit("needs a C compiler (apt-get install -y gcc)")
    with tempfile.TemporaryDirectory(prefix="askonce-mypyc-") as tmp:
        tree = Path(tmp) / "src"
        shutil.copytree(ROOT / "src", tree, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        build(tree)
        runs: dict[bool, list[tuple[float, float, float]]] = {False: [], True: []}
        for _ in range(args.rounds):
            for src in (ROOT / "src", tree):
                compiled, bare, mw, parse = probe(src)
                runs[compiled].append((bare, mw, parse))
        if not runs[True]:
            raise SystemExit("the compiled modules were not the ones imported")
        print("| tree | bare app (us) | middleware (us) | middleware's own (us) | parse_frame (us) |")
        print("|---|---:|---:|---:|---:|")
        for compiled, rows in runs.items():
            bare, mw, parse = (statistics.median(r[i] for r in rows) for i in range(3))
            print(f"| {'compiled (mypyc)' if compiled else 'pure'} | {bare:.2f} | {mw:.2f} | {mw - bare:.2f} | "
                  f"{parse:.2f} |")
        print(f"\nCPU time of the probing thread, medians of {args.rounds} interpreters x 7 rounds x 5000 requests.")
        if args.tests:
            done = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:warnings",
                                   *[t for t in TESTS if (ROOT / t).exists()]], cwd=ROOT,
                                  env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True)
            failed = [line for line in done.stdout.splitlines() if line.startswith("FAILED")]
            print("\nTests on the compiled tree:", done.stdout.strip().splitlines()[-1])
            print("\n".join(failed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
