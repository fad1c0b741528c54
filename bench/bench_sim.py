"""How fast the simulator runs: simulated questions per second of wall time.

    python bench/bench_sim.py                                  # 1,000,000 questions, E2 (10 %), 3 layers, askonce
    python bench/bench_sim.py --policy naive --questions 200000
    python bench/bench_sim.py --profile                        # where the time goes (cProfile, top 25)
    python bench/bench_sim.py --compare-simpy                  # the heap loop against SimPy (if installed)

The goal is 1,000,000 simulated questions in under 60 s on one core.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time

from askonce.sim.model import Sim
from askonce.sim.scenarios import Knobs, preset
from askonce.sim.world import World


def run(questions: int, policy: str, depth: int, error_rate: float, rate: float, seed: int) -> None:
    world = World(depth=depth, clients=100, rate=rate, duration=questions / rate, error_rate=error_rate)
    sim = Sim(world, preset(policy, Knobs()), seed)
    started = time.perf_counter()
    stats = sim.run()
    wall = time.perf_counter() - started
    reached = sum(v for k, v in stats.hist.items() if k > 0)
    print(f"policy={policy} depth={depth} error_rate={error_rate} questions={stats.issued} "
          f"arrivals={stats.arrivals} events={sim.engine.events}")
    print(f"A={stats.arrivals / max(1, reached):.4f} success={stats.ok / max(1, stats.issued):.5f}")
    print(f"wall {wall:.2f} s  ->  {stats.issued / wall:,.0f} questions/s, {sim.engine.events / wall:,.0f} events/s")


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
    args = ap.parse_args()
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
