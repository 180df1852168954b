"""Replan-time benchmark: full plan search for PPO on Llama-3.1-8B (or ``--models``) at 16 ... 4096 H100s.

Prints, per pool size, the median milliseconds of the search alone (``search``: candidates,
frontier, knapsack + branch and bound) and of ``plan_job`` (search + placement + estimate), as CPU
time of this process (``time.process_time``: stable on a loaded machine; ``--wall`` for wall-clock),
the candidates enumerated, the frontier size, the knapsacks solved and how mixed placements
went (``used:``/``skipped:`` stages, :class:`nereus.planner.search.SearchResult`). One CPU process.
``--framework`` picks the job's framework preset (``nereus``, the default, or ``megatron``,
``fsdp``, ``deepspeed``, ``generic``: colocation, offload and ZeRO widen the space).

    python benchmarks/bench_replan.py [--repeats 5] [--sizes 256,4096] [--models llama-3.1-8b,llama-3.3-70b,qwen3-32b]
        [--framework nereus]
"""

from __future__ import annotations

import argparse
import statistics
import time

from nereus.cost.model import CostModel
from nereus.planner.search import plan_job, search
from nereus.spec.framework import get_framework
from nereus.spec.hardware import ClusterSpec, get_gpu
from nereus.spec.job import JobSpec
from nereus.spec.presets import get_model
from nereus.spec.workload import WorkloadSpec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sizes", default="16,64,256,1024,4096")
    ap.add_argument("--models", default="llama-3.1-8b", help="comma-separated model presets")
    ap.add_argument("--framework", default="nereus", help="framework preset of the job")
    ap.add_argument("--wall", action="store_true", help="wall-clock instead of CPU time")
    args = ap.parse_args()
    clock = time.perf_counter if args.wall else time.process_time
    print(f"{'model':>14} {'GPUs':>6} {'search ms':>10} {'plan_job ms':>12} {'candidates':>11} {'frontier':>9} "
          f"{'knapsacks':>10} {'L_step s':>9}  mixed")
    for model, n in ((m, int(s)) for m in args.models.split(",") for s in args.sizes.split(",")):
        job = JobSpec(get_model(model), ClusterSpec(get_gpu("h100"), n // 8, 8),
                      WorkloadSpec(algorithm="ppo", prompt_len=1024, response_len=2048),
                      framework=get_framework(args.framework))
        s_ms, p_ms = [], []
        for _ in range(args.repeats):
            cm = CostModel(job)
            t0 = clock()
            res = search(cm, n, n > 8)
            s_ms.append((clock() - t0) * 1e3)
            t0 = clock()
            plan = plan_job(job, cost=CostModel(job))
            p_ms.append((clock() - t0) * 1e3)
        print(f"{model:>14} {n:>6} {statistics.median(s_ms):>10.1f} {statistics.median(p_ms):>12.1f} "
              f"{res.candidates_enumerated:>11} {res.frontier_size:>9} {res.knapsacks:>10} {plan.l_step:>9.2f}  "
              f"{_mixed(res)}")


def _mixed(res) -> str:
    """How the search treated mixed placements: the stages placed mixed, the stages whose mixed
    placements were skipped (too large), or ``-``."""
    used = [s for s, m in res.modes.items() if m == "mixed"]
    out = [f"used:{','.join(used)}"] if used else []
    if res.mixed_skipped:
        out.append(f"skipped:{','.join(res.mixed_skipped)}")
    return " ".join(out) or "-"


if __name__ == "__main__":
    main()
