"""Peak memory of building one worker's model shard from random initial weights, per shard vs full.

For each model and TP degree, a fresh process builds TP rank 0's ``LlamaShard`` (pp=1) twice over:

* ``full``: ``init_full_params`` then slice (what every worker did before per-shard initialization);
* ``shard``: ``init_shard_params`` draws only the tiles the shard overlaps (what workers do now).

Prints the model's and the shard's fp32 bytes, the process's peak resident-set growth while building
(``getrusage`` maximum RSS after minus before, MB), the random elements drawn (``shard`` mode) and the
seconds taken. ``--models small,llama-3.1-8b:1`` takes presets, ``:L`` keeping only L decoder layers.

    python benchmarks/bench_init_memory.py [--models small,llama-3.1-8b:1] [--tp 1,4]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

CHILD = r'''
import dataclasses, math, resource, sys, time
import torch
from nereus.runtime.comm.instrument import Meter
from nereus.runtime.model.sharding import init_full_params, param_shapes
from nereus.runtime.model.llama import LlamaShard
from nereus.runtime.comm.parallel import Layout, ParallelContext
from nereus.spec.presets import get_model
name, layers, tp, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
spec = get_model(name)
if layers:
    spec = dataclasses.replace(spec, num_layers=layers)
ctx = ParallelContext(Layout(tp, 1, 1, tuple(range(tp))), 0, 0, 0, 0, None, None, None, None)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
stats = {}
if mode == "full":
    m = LlamaShard(spec, ctx, 0, Meter(), full=init_full_params(spec, 0))
else:
    import nereus.runtime.model.llama as M
    draw = M.init_shard_params
    M.init_shard_params = lambda *a, **k: draw(*a, **k, stats=stats)
    m = LlamaShard(spec, ctx, 0, Meter())
dt = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
full = sum(math.prod(s) * 4 for s, _ in param_shapes(spec).values())
shard = sum(p.numel() * p.element_size() for p in m.params.values())
drawn = f"{stats['generated'] * 4 / 1e6:10.1f}" if stats else f"{'-':>10}"
print(f"{name:<14} {spec.num_layers:>6} {tp:>3} {mode:<6} {full / 1e6:9.1f} {shard / 1e6:9.1f} "
      f"{(peak - before) / 1e3:13.1f} {drawn} {dt:7.1f}", flush=True)
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="small,llama-3.1-8b:1")
    ap.add_argument("--tp", default="1,4")
    args = ap.parse_args()
    print(f"{'model':<14} {'layers':>6} {'tp':>3} {'mode':<6} {'model MB':>9} {'shard MB':>9} "
          f"{'peak RSS +MB':>13} {'drawn MB':>10} {'seconds':>7}")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    for item in args.models.split(","):
        name, _, layers = item.partition(":")
        for tp in (int(t) for t in args.tp.split(",")):
            for mode in ("full", "shard"):
                subprocess.run([sys.executable, "-c", CHILD, name, layers or "0", str(tp), mode], check=True,
                               env=env, timeout=1800)


if __name__ == "__main__":
    main()
