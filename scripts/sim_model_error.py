"""How far a policy's planner is from the simulated truth on the plan it runs (docs/simulate.md,
"How large the model error is").

For every completed step of one ``nereus simulate`` policy run, compares the policy planner's
estimate of the running plan (``planner.estimate`` for that step's response length and pool, with
the calibration of the steps before it) with the truth's step time without noise
(``SimulatedCluster.true_plan``), and prints the median, 90th percentile and first-step relative
error ``|estimate − truth| / truth``, and how many distinct plans it ran.

Usage::

    python scripts/sim_model_error.py                       # nereus and uncalibrated, default scenario
    python scripts/sim_model_error.py --policies nereus --trace parcae-hl --seed 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from nereus.sim.cluster import SimulatedCluster  # noqa: E402
from nereus.sim.policies import make_policy  # noqa: E402
from nereus.sim.run import simulate  # noqa: E402
from nereus.sim.scenario import Scenario  # noqa: E402


def errors(name: str, scenario: Scenario) -> list[float]:
    """Relative errors of ``name``'s planner on its running plan, one per completed step."""
    job, hours = scenario.job(), scenario.duration_hours()
    cluster = SimulatedCluster(job, scenario.availability(), scenario.lengths(), scenario.truth,
                               seed=scenario.seed, hours=hours)
    policy = make_policy(name, job, scenario.gamma, scenario.truth.table(), scenario.truth.memory_factor,
                         scenario.restart, future=lambda gpus, t: 0.0, first_horizon=scenario.first_horizon)
    out: list[float] = []
    run = cluster.execute_step

    def step(plan, k, t):
        o = run(plan, k, t)
        if o.completed:
            pool = cluster.pool_at(t)
            truth = cluster.true_plan(plan, o.response_len, t).l_step
            est = policy.planner.estimate(cluster.job_at(o.response_len), plan, pool).l_step
            out.append(abs(est - truth) / truth)
        return o
    cluster.execute_step = step
    simulate(policy, cluster, hours, scenario.restart)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policies", default="nereus,uncalibrated")
    ap.add_argument("--trace", default="bamboo-p3")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hours", type=float, default=4.0)
    a = ap.parse_args(argv)
    scenario = Scenario(trace=a.trace, seed=a.seed, hours=a.hours)
    for name in a.policies.split(","):
        e = errors(name, scenario)
        if not e:
            print(f"{name}: no completed step")
            continue
        p90 = sorted(e)[int(0.9 * (len(e) - 1))]
        print(f"{name}: {len(e)} steps, error median {100 * statistics.median(e):.1f}%, "
              f"90th percentile {100 * p90:.1f}%, first step {100 * e[0]:.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
