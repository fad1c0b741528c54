"""How fast the simulator runs: simulated questions per second of wall time.

    python bench/bench_sim.py                                  # 1,000,000 questions, E2 (10 %), 3 layers, askonce
    python bench/bench_sim.py --policy naive --questions 200000
    python bench/bench_sim.py --profile                        # where the time goes (cProfile, top 25)
    python bench/bench_sim.py --compare-simpy                  # the heap loop against SimPy (if installed)
    python bench/bench_sim.py --compare /tmp/before/src --repeat 3   # against another tree's src

A run prints its process CPU seconds (what other load on the machine changes least), its wall
seconds and its peak RSS. ``--compare SRC`` runs this file in child processes, alternating
``PYTHONPATH=SRC`` and this tree's src, ``--repeat`` times each, and prints the median CPU
seconds of each, their spread (min-max) and the ratio; results in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import random
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from askonce.sim.model import Sim
from askonce.sim.scenarios import Knobs, preset
from askonce.sim.world import World


def run(questions: int, policy: str, depth: int, error_rate: float, rate: float, seed: int) -> None:
    world = World(depth=depth, clients=100, rate=rate, duration=questions / rate, error_rate=error_rate)
    sim = Sim(world, preset(policy, Knobs()), seed)
    started, cpu_started = time.perf_counter(), time.process_time()
    stats = sim.run()
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    reached = sum(v for k, v in stats.hist.items() if k > 0)
    print(f"policy={policy} depth={depth} error_rate={error_rate} questions={stats.issued} "
          f"arrivals={stats.arrivals} events={sim.engine.events}")
    print(f"A={stats.arrivals / max(1, reached):.4f} success={stats.ok / max(1, stats.issued):.5f}")
    print(f"wall {wall:.2f} s  ->  {stats.issued / wall:,.0f} questions/s, {sim.engine.events / wall:,.0f} events/s")
    # ru_maxrss is in KiB on Linux: the peak of the whole process, imports included.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"cpu {cpu:.2f} s  ->  {stats.issued / cpu:,.0f} questions/s;  peak RSS {rss:.1f} MiB")


def _field(pattern: str, out: str) -> float:
    found = re.search(pattern, out, re.M)
    if found is None:
        raise SystemExit(f"no {pattern!r} in the run's output:\n{out}")
    return float(found.group(1))


def compare(before: str, repeat: int, argv: list[str]) -> None:
    """This file under ``before``'s src and under this tree's, alternately, each in its own
    process; the median and spread of each one's CPU and wall seconds."""
    here = str(Path(__file__).resolve().parents[1] / "src")
    runs: dict[str, list[tuple[float, float, float]]] = {"before": [], "after": []}
    for i in range(repeat):
        for name, src in (("before", before), ("after", here)):
            env = {**os.environ, "PYTHONPATH": src}
            out = subprocess.run([sys.executable, __file__, *argv], env=env, check=True,
                                 capture_output=True, text=True).stdout
            patterns = (r"^cpu ([0-9.]+) s", r"^wall ([0-9.]+) s", r"peak RSS ([0-9.]+) MiB")
            cpu, wall, rss = (_field(pattern, out) for pattern in patterns)
            runs[name].append((cpu, wall, rss))
            print(f"run {i + 1} {name}: cpu {cpu:.2f} s, wall {wall:.2f} s, peak RSS {rss:.1f} MiB",
                  flush=True)
    med = {}
    for name, rows in runs.items():
        cpus, walls = [r[0] for r in rows], [r[1] for r in rows]
        med[name] = statistics.median(cpus), statistics.median(walls)
        print(f"{name}: cpu median {med[name][0]:.2f} s (min {min(cpus):.2f}, "
              f"max {max(cpus):.2f}), wall median {med[name][1]:.2f} s "
              f"(min {min(walls):.2f}, max {max(walls):.2f}), "
              f"peak RSS max {max(r[2] for r in rows):.1f} MiB")
    print(f"after/before: cpu {med['after'][0] / med['before'][0]:.3f}, "
          f"wall {med['after'][1] / med['before'][1]:.3f}")


def compare_simpy(n: int = 400_000) -> None:
    """Chains of 10 timeouts, n timeouts in all: the shape of a hop's wait-and-retry, nothing else."""
    rng = random.Random(1)
    delays = [rng.random() for _ in range(n)]

    from askonce.sim.engine import Engine

    engine = Engine()
    left = [10] * (n // 10)
    it = iter(delays)

    def step(i: int) -> None:
        left[i] -= 1
        if left[i] > 0:
            engine.after(next(it), step, i)

    for i in range(n // 10):
        engine.at(next(it), step, i)
    started = time.perf_counter()
    engine.run()
    heap_rate = n / (time.perf_counter() - started)
    print(f"askonce.sim.engine: {heap_rate:,.0f} timeouts/s")
    try:
        import simpy  # type: ignore[import-untyped, import-not-found, unused-ignore]
    except ImportError:
        print("simpy is not installed (pip install simpy) - nothing to compare")
        return
    env = simpy.Environment()
    it2 = iter(delays)

    def proc(env: simpy.Environment):  # type: ignore[no-untyped-def]
        for _ in range(10):
            yield env.timeout(next(it2))

    for _ in range(n // 10):
        env.process(proc(env))
    started = time.perf_counter()
    env.run()
    simpy_rate = n / (time.perf_counter() - started)
    print(f"simpy {simpy.__version__}: {simpy_rate:,.0f} timeouts/s  (heap loop is {heap_rate / simpy_rate:.1f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=int, default=1_000_000)
    ap.add_argument("--policy", default="askonce")
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--error-rate", type=float, default=0.1)
    ap.add_argument("--rate", type=float, default=1000.0, help="questions per simulated second")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--compare-simpy", action="store_true")
    ap.add_argument("--compare", metavar="SRC", help="another tree's src to run against this one")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each tree with --compare")
    args = ap.parse_args()
    if args.compare:
        argv = ["--questions", str(args.questions), "--policy", args.policy, "--depth",
                str(args.depth), "--error-rate", str(args.error_rate), "--rate", str(args.rate),
                "--seed", str(args.seed)]
        compare(args.compare, args.repeat, argv)
        return
    if args.compare_simpy:
        compare_simpy()
        return
    if args.profile:
        profiler = cProfile.Profile()
        profiler.runcall(run, args.questions, args.policy, args.depth, args.error_rate, args.rate, args.seed)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        return
    run(args.questions, args.policy, args.depth, args.error_rate, args.rate, args.seed)


if __name__ == "__main__":
    main()
