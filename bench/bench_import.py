"""``import askonce`` time in a fresh interpreter, against tenacity, stamina and backoff in the same run.

Each measurement is a new ``python -c`` process timing its own ``import`` with ``perf_counter_ns``
(interpreter start-up excluded); libraries are interleaved and the median of the runs is reported. It
also lists what ``import askonce`` pulls in (``-X importtime``) and fails if that includes asyncio or
any web/RPC framework: integrations must be imported lazily.

Issue 16's goal is the ratio askonce / tenacity of the wall medians, at most 0.5. Beside the bare
import it times a first use, in a fresh interpreter too: the import, decorating a function and one
call (askonce's default store is made on the first call), against tenacity doing the same; so a cost
moved from the import to the first use shows. ``--before SRC`` adds another askonce tree (its
``src`` directory, e.g. a worktree of the previous commit), imported in the same rounds, for a
before/after table.

    python bench/bench_import.py                        # markdown tables, ~10 s
    python bench/bench_import.py --before /path/to/old/src
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

LIBS = ("askonce", "tenacity", "stamina", "backoff")
TARGET_MS = 15.0
TARGET_RATIO = 0.5  # issue 16: askonce / tenacity, wall medians
BEFORE = "askonce (before)"

# A first use: import, decorate one function, call it once (it succeeds).
FIRST_USE = {
    "askonce": "import askonce\n@askonce.retry(on=ConnectionError)\ndef f(): return 1\nf()",
    "tenacity": ("import tenacity\n@tenacity.retry(retry=tenacity.retry_if_exception_type("
                 "ConnectionError), stop=tenacity.stop_after_attempt(3))\ndef f(): return 1\nf()"),
}
FRAMEWORKS = ("asyncio", "fastapi", "starlette", "flask", "werkzeug", "httpx", "httpcore", "requests", "urllib3",
              "grpc", "redis", "prometheus_client", "opentelemetry", "rich", "uvicorn", "waitress", "anyio",
              "sniffio", "h11", "pydantic", "structlog", "trio")

PROBE = """
import sys, time, json
program = compile({code!r}, "<probe>", "exec")
before = set(sys.modules)
c0, t0 = time.process_time_ns(), time.perf_counter_ns()
exec(program, {{}})
t1, c1 = time.perf_counter_ns(), time.process_time_ns()
new = set(sys.modules) - before
print(json.dumps({{"ns": t1 - t0, "cpu_ns": c1 - c0, "new": sorted(new)}}))
"""


def _env(src: str | None = None) -> dict[str, str]:
    """Bytecode cached for every library alike, as after an ordinary install.

    The peers come with ``.pyc`` files from pip; askonce, installed editable, has none, and with
    ``PYTHONDONTWRITEBYTECODE`` set (as on the project's machines) it would be compiled from source at
    every import. A private cache directory keeps the repository free of ``__pycache__``.
    """
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = os.path.join(tempfile.gettempdir(), "askonce-bench-pycache")
    if src is not None:  # another askonce tree first on the path
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    return env


def probe(lib: str, src: str | None = None, code: str | None = None) -> dict[str, object]:
    """One fresh interpreter running ``code`` (default ``import lib``), timed around it."""
    program = PROBE.format(code=code or f"import {lib}")
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                         check=True, timeout=30, env=_env(src))
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def importtime(lib: str) -> list[tuple[int, int, str]]:
    """``-X importtime`` rows of the modules ``import lib`` loaded: (self us, cumulative us, module).

    Only ``lib``'s own subtree: what the interpreter's start-up (``site``, ``.pth`` files) imported
    before is not ``lib``'s cost.
    """
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {lib}"], capture_output=True,
                         text=True, check=True, timeout=30, env=_env())
    rows: list[tuple[int, int, int, str]] = []
    for line in out.stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        self_us, cum_us, name = line[len("import time:"):].split("|")
        depth = (len(name) - len(name.lstrip(" "))) // 2
        rows.append((int(self_us), int(cum_us), depth, name.strip()))
    # Rows come children first; lib's subtree is the run of deeper rows just before its own row.
    end = max(i for i, r in enumerate(rows) if r[3] == lib and r[2] == 0)
    start = end
    while start > 0 and rows[start - 1][2] > 0:
        start -= 1
    return [(s, c, name) for s, c, _, name in rows[start:end + 1]]


def verdict(ok: bool) -> str:
    return "pass" if ok else "**FAIL**"


def run(runs: int, before: str | None = None) -> tuple[str, list[str]]:
    """The report, and what `import askonce` imported that it must not."""
    load_before = os.getloadavg()[0]
    # (label, library, src, code): every probe of a round, interleaved
    probes = [(lib, lib, None, None) for lib in LIBS]
    if before is not None:
        probes.insert(1, (BEFORE, "askonce", before, None))
    probes += [(f"{lib}, first use", lib, None, code) for lib, code in FIRST_USE.items()]
    if before is not None:
        probes.append((f"{BEFORE}, first use", "askonce", before, FIRST_USE["askonce"]))
    for _, lib, src, code in probes:  # warm the bytecode cache and the page cache
        probe(lib, src, code)
        probe(lib, src, code)
    times: dict[str, list[float]] = {label: [] for label, *_ in probes}
    cpu: dict[str, list[float]] = {label: [] for label, *_ in probes}
    new_modules: dict[str, list[str]] = {}
    for _ in range(runs):
        for label, lib, src, code in probes:
            result = probe(lib, src, code)
            times[label].append(int(result["ns"]) / 1e6)  # type: ignore[call-overload]
            cpu[label].append(int(result["cpu_ns"]) / 1e6)  # type: ignore[call-overload]
            new_modules[label] = list(result["new"])  # type: ignore[call-overload]
    load_after = os.getloadavg()[0]
    medians = {label: statistics.median(t) for label, t in times.items()}
    cpu_medians = {label: statistics.median(t) for label, t in cpu.items()}
    imports = [label for label, _, _, code in probes if code is None]

    lines = [
        "### `import` time in a fresh interpreter",
        "",
        f"{datetime.date.today().isoformat()}, Python {platform.python_version()}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs, load average {load_before:.1f} -> {load_after:.1f}; median of {runs} runs each, "
        "interleaved, bytecode cached for all. Wall: `perf_counter_ns` around the import; CPU: `process_time_ns` "
        "(blind to other processes on a loaded machine).",
        "",
        "| library | wall (ms), median | min | max | CPU (ms), median | modules added | asyncio | frameworks |",
        "|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for label in imports:
        new = new_modules[label]
        top = {m.split(".")[0] for m in new}
        frameworks = sorted(f for f in FRAMEWORKS if f in top and f != "asyncio")
        lines.append(f"| {label} | {medians[label]:.1f} | {min(times[label]):.1f} | {max(times[label]):.1f} "
                     f"| {cpu_medians[label]:.1f} | {len(new)} | {'yes' if 'asyncio' in top else 'no'} "
                     f"| {', '.join(frameworks) or 'none'} |")
    lines.append("")
    lines.append("Peer / askonce, wall medians: " + ", ".join(
        f"{peer} {medians[peer] / medians['askonce']:.2f}x" for peer in LIBS[1:]) + ".")

    def ratio_row(what: str, label: str, peer: str) -> str:
        wall, cpu_ratio = medians[label] / medians[peer], cpu_medians[label] / cpu_medians[peer]
        return f"| {what} | {wall:.2f}x | {cpu_ratio:.2f}x | {verdict(wall <= TARGET_RATIO)} |"

    first = [label for label, _, _, code in probes if code is not None]
    lines += [
        "",
        "First use in a fresh interpreter: the import, decorating one function, one call (askonce:"
        " `@askonce.retry(on=ConnectionError)`; tenacity: `@tenacity.retry(retry="
        "retry_if_exception_type(ConnectionError), stop=stop_after_attempt(3))`):",
        "",
        "| first use | wall (ms), median | min | max | CPU (ms), median | modules added |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label in first:
        t = times[label]
        lines.append(f"| {label.removesuffix(', first use')} | {medians[label]:.1f} | {min(t):.1f} "
                     f"| {max(t):.1f} | {cpu_medians[label]:.1f} | {len(new_modules[label])} |")
    lines += [
        "",
        f"| askonce / tenacity (issue 16: at most {TARGET_RATIO:g}x) | wall | CPU | result (wall) |",
        "|---|---:|---:|---|",
        ratio_row("`import`", "askonce", "tenacity"),
        ratio_row("first use", "askonce, first use", "tenacity, first use"),
    ]
    if before is not None:
        lines += [ratio_row("`import`, before", BEFORE, "tenacity"),
                  ratio_row("first use, before", f"{BEFORE}, first use", "tenacity, first use")]

    runs_of_rows = [importtime("askonce") for _ in range(5)]
    by_module: dict[str, list[tuple[int, int]]] = {}
    for run_rows in runs_of_rows:
        for s, c, name in run_rows:
            by_module.setdefault(name, []).append((s, c))
    rows = [(int(statistics.median(s for s, _ in v)), int(statistics.median(c for _, c in v)), name)
            for name, v in by_module.items()]
    own = [r for r in rows if r[2].startswith("askonce")]
    lines += [
        "",
        "Where `import askonce` spends it, heaviest first (`python -X importtime -c 'import askonce'`, self "
        "time, median of 5 runs):",
        "",
        "| module | self (µs) | cumulative (µs) |",
        "|---|---:|---:|",
    ]
    lines += [f"| {name} | {s:,} | {c:,} |" for s, c, name in sorted(rows, key=lambda r: -r[0])[:15]]
    lines.append(f"| *total: askonce's own {len(own)} modules / the {len(rows) - len(own)} others* "
                 f"| {sum(r[0] for r in own):,} / {sum(r[0] for r in rows if r not in own):,} | |")

    top = {m.split(".")[0] for m in new_modules["askonce"]}
    bad = sorted(f for f in FRAMEWORKS if f in top)
    lines += [
        "",
        "| target (issue 2) | wall | CPU | result (wall / CPU) |",
        "|---|---:|---:|---|",
        f"| `import askonce` <= {TARGET_MS:g} ms | {medians['askonce']:.1f} ms | {cpu_medians['askonce']:.1f} ms "
        f"| {verdict(medians['askonce'] <= TARGET_MS)} / {verdict(cpu_medians['askonce'] <= TARGET_MS)} |",
        f"| imports neither asyncio nor any framework | {', '.join(bad) or 'none'} | | {verdict(not bad)} |",
    ]
    return "\n".join(lines), bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--before", metavar="SRC",
                    help="another askonce tree's src directory, measured in the same rounds")
    args = ap.parse_args(argv)
    report, bad = run(args.runs, args.before)
    print(report)
    if bad:  # a rule, not a figure: asyncio and frameworks are imported only by the integrations that need them
        print(f"\nimport askonce imported {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
