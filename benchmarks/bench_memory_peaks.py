"""Measured vs predicted peak device memory per worker of fixed-layout ``nereus run`` runs (issue 24).

Each configuration is one ``nereus run`` (``small`` model, PPO, fp32, 2 CPU workers, both trainers at
``tp1 pp1 dp2``, the other model-stages at ``1,1,1``) with the worker capacity enforced. *Measured*:
each worker's peak of tracked tensor bytes over the run (``comm/instrument.py``: engine state, the
gradient buffers and ZeRO buffers, the storages saved for backward, KV cache, gathered ZeRO-3 units);
*predicted*: the cost model's per-GPU peak of the same plan less the CUDA workspace, with the runtime
engine's training terms (``nereus/cost/runtime_memory.py``; ``run/memreport.py: worker_rows``).

Configurations (:data:`CONFIGS`): plain DP, ZeRO-1, ZeRO-2 and ZeRO-3 with disjoint placement; the
same colocated on workers 0-1 (verl's hybrid engine: trained state offloaded to host memory between
turns, frozen and derived copies dropped), i.e. offload plus colocation.

Usage::

    python benchmarks/bench_memory_peaks.py                 # every configuration, 2 steps each
    python benchmarks/bench_memory_peaks.py --only z1-col,z3-col --steps 3

Prints one line per worker and configuration: measured MB, predicted MB, measured/predicted; exits 1
when a ratio is outside ``[0.9, 1.1]`` (the issue's bound).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

BASE = ["--model", "small", "--workers", "2", "--layout", "actor.train=1,1,2", "--layout", "critic.train=1,1,2",
        "--enforce-memory"]
#: name -> (extra options, per-worker capacity GiB)
CONFIGS = {
    "dp": ([], 0.2), "z1": (["--zero", "1"], 0.2), "z2": (["--zero", "2"], 0.2), "z3": (["--zero", "3"], 0.2),
    "dp-col": (["--colocate"], 0.2), "z1-col": (["--colocate", "--zero", "1"], 0.1),
    "z2-col": (["--colocate", "--zero", "2"], 0.1), "z3-col": (["--colocate", "--zero", "3"], 0.05),
}


def run(name: str, steps: int, out_dir: str) -> list[dict]:
    """The ``workers_vs_predicted`` rows of one configuration's run.

    Raises:
        RuntimeError: the run failed (its last stderr lines)."""
    extra, gib = CONFIGS[name]
    path = os.path.join(out_dir, f"{name}.json")
    cmd = [sys.executable, "-m", "nereus.cli", "run", *BASE, "--memory-gib", str(gib), "--steps", str(steps),
           "--json", path, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        raise RuntimeError(f"{name}: {' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    with open(path) as f:
        return json.load(f)["measurements"]["workers_vs_predicted"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(CONFIGS), help=f"comma-separated subset of {list(CONFIGS)}")
    p.add_argument("--steps", type=int, default=2, help="RL steps per run")
    args = p.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    bad = [n for n in names if n not in CONFIGS]
    if bad:
        p.error(f"--only: unknown configurations {bad}; valid: {list(CONFIGS)}")
    ok = True
    print(f"{'config':<8} {'worker':>6} {'measured MB':>12} {'predicted MB':>13} {'ratio':>6}")
    with tempfile.TemporaryDirectory() as tmp:
        for n in names:
            for r in run(n, args.steps, tmp):
                ok &= r["ratio"] is not None and 0.9 <= r["ratio"] <= 1.1
                print(f"{n:<8} {r['worker']:>6} {r['measured'] / 1e6:12.3f} {r['predicted'] / 1e6:13.3f} "
                      f"{r['ratio']:6.3f}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
