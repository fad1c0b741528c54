"""A discrete-event simulator that drives askonce's own core on a virtual clock.

Every hop of a simulated stack decides with the shipped :mod:`askonce.core` objects
(``RetryState``, ``Account`` escrow and ``settle``, ``TokenBucket``, ``Breaker``, ``Ledger``,
``mint_key``), so what the simulator measures is what the library does, at scales and for
durations a real stack cannot reach.

::

    from askonce.sim import Sim, World, preset
    stats = Sim(World(depth=3, error_rate=0.1, duration=10), preset("askonce"), seed=1).run()

``askonce simulate`` runs the standard experiments (:mod:`askonce.sim.scenarios`);
``docs/results.md`` holds their tables. Nothing here imports matplotlib until plots are asked for.
"""

from askonce.sim.engine import Engine
from askonce.sim.model import Sim
from askonce.sim.scenarios import POLICIES, Knobs, Row, preset, run_one, summarise
from askonce.sim.world import Policy, Stats, World

__all__ = ["POLICIES", "Engine", "Knobs", "Policy", "Row", "Sim", "Stats", "World", "preset",
           "run_one", "summarise"]
