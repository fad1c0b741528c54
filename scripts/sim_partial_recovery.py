"""Issue 13 experiment: a full outage for 10 s, then the target comes back only partly
(independent errors at 0, 50 or 90 %). Success = answers completed in the interval / questions
issued in it (so it can exceed 100 % as the backlog drains). Not a shipped scenario.

PYTHONPATH=src python scripts/sim_partial_recovery.py [DEPTH]
"""

import dataclasses
import sys

from askonce.core.admission import AdmissionPolicy
from askonce.core.breaker import BreakerPolicy
from askonce.sim.model import Sim
from askonce.sim.scenarios import Knobs, preset
from askonce.sim.world import World

OLD = Knobs(admission=None, askonce_breaker=True)
NEAR_TOTAL = BreakerPolicy(window="time", window_size=10, minimum_calls=100, failure_rate=1.0)
DESIGNS = {
    "no-retry": ("no-retry", Knobs()),
    "old askonce": ("askonce", OLD),
    "D1 breaker 1.0/10s": ("askonce", Knobs(admission=None, breaker=NEAR_TOTAL,
                                            askonce_breaker=True)),
    "D1' ... probes 1": ("askonce", Knobs(admission=None, askonce_breaker=True,
                         breaker=dataclasses.replace(NEAR_TOTAL, half_open_probes=1))),
    "D3 admission (default)": ("askonce", Knobs()),
    "D3 min_success 0.02": ("askonce", Knobs(admission=AdmissionPolicy(min_success=0.02))),
    "D2 adm + D1' brk": ("askonce", Knobs(askonce_breaker=True, breaker=dataclasses.replace(
        NEAR_TOTAL, half_open_probes=1))),
}
depth = int(sys.argv[1]) if len(sys.argv) > 1 else 1
for p in (0.0, 0.5, 0.9):
    for label, (name, knobs) in DESIGNS.items():
        w = World(depth=depth, rate=1000.0, duration=30.0, outage=(0.0, 10.0), error_rate=p)
        sim = Sim(w, preset(name, knobs), 1)
        st = sim.run()
        b = st.goodput_bins + [0] * 40
        rec = sum(b[10:12]) / 2000
        after = sum(b[12:30]) / 18000
        print(f"N={depth} errors after {p:.0%} {label:24s} success 10-12 s {rec:6.1%}  "
              f"12-30 s {after:6.1%}  arrivals {st.arrivals}")
