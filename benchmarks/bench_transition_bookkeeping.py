"""Bookkeeping of live transitions at real model sizes: planning and packing without data.

Source: issue 26 (``plan_moves`` took 21 s per worker for a Llama-3.3-70B TP4 PP16 Extend; the
per-piece region lookups 14.8 s per Extend sender for Llama-3.1-8B at TP 1).

For each case, a worker's part of one primitive is run on ``meta`` tensors (shapes only, no
memory, no arithmetic): ``plans.plan_moves`` for that worker, ``packing.pack`` of its send buffers,
``packing.recv_sizes`` and ``packing.assemble`` of its produced shards: everything
``Transit.exchange`` does except the wire. Every memoized index and plan is cleared before each
worker (``plans.cache_clear``), so the seconds are cold (the first transition of a layout); a
weight sync that repeats a plan pays only the pack and assembly. Seconds per worker are the
largest over the workers timed (the first and last sender, the first and last receiver).

Cases (fp32 training state: weights, two Adam moments): Llama-3.1-8B TP1 Extend (one replica to
a second), TP2 PP2 -> two TP1 PP2 copies (Split), TP1 PP2 -> TP2 PP1 on the same GPUs (Merge);
Llama-3.3-70B TP4 PP16 Extend (64 GPUs to 64 more) and TP8 PP8 Split into TP4 PP8 copies.

    python benchmarks/bench_transition_bookkeeping.py [--json out.json]

Last line: ``llama-3.3-70b tp4 pp16 extend: X.XXX s per worker``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from nereus.runtime.model.precision import train_kinds
from nereus.runtime.transit.index import stage_regions
from nereus.runtime.transit.packing import COUNTERS, assemble, pack, recv_sizes
from nereus.runtime.transit.plans import MoveSpec, UnitMeta, cache_clear, kind_dtype, plan_moves
from nereus.runtime.transit.worker_side import Unit
from nereus.spec.presets import get_model

KINDS = train_kinds("fp32")


def _unit(spec, meta: UnitMeta, worker: int) -> Unit:
    """``worker``'s shard of ``meta`` as meta tensors of every kind."""
    from nereus.runtime.transit.index import shapes

    p, t = meta.position(worker)
    shp = shapes(spec)
    tensors: dict = {}
    for name, r in stage_regions(spec, meta.tp, meta.pp, p, t).items():
        shape = list(shp[name][0])
        if r.dim is not None:
            shape[r.dim] = r.length
        for k in KINDS:
            tensors.setdefault(k, {})[name] = torch.empty(shape, dtype=kind_dtype(k, torch.float32), device="meta")
    return Unit(meta, tensors, dict.fromkeys(COUNTERS, 0))


def run_worker(spec, move: MoveSpec, worker: int) -> dict:
    """Plan, pack and assemble ``worker``'s part of ``move`` on meta tensors; seconds of each."""
    cache_clear()
    units = {u.uid: _unit(spec, u, worker) for u in move.sources + move.local if worker in u.gpus}
    t0 = time.perf_counter()
    plan = plan_moves(spec, move, worker)
    t1 = time.perf_counter()
    bufs = pack(spec, plan, worker, units.__getitem__, torch.float32, "meta")
    t2 = time.perf_counter()
    sizes = recv_sizes(spec, plan, worker, torch.float32)
    recv = {s: (torch.empty(n, dtype=torch.uint8, device="meta"), dict.fromkeys(COUNTERS, 0)) for s, n in sizes.items()}
    assemble(spec, plan, move, worker, recv, units.__getitem__, torch.float32, "meta")
    t3 = time.perf_counter()
    return {"worker": worker, "plan_s": t1 - t0, "pack_s": t2 - t1, "assemble_s": t3 - t2, "total_s": t3 - t0,
            "sent": sum(n for _b, n in bufs.values()), "recv": sum(sizes.values()),
            "pieces": sum(len(v) for v in plan.pairs.values())}


def cases() -> list[tuple[str, object, MoveSpec, tuple[int, ...]]]:
    """(name, spec, move, workers timed)."""
    s8, s70 = get_model("llama-3.1-8b"), get_model("llama-3.3-70b")
    out = []

    def extend(name, spec, tp, pp):
        n = tp * pp
        src = UnitMeta("a#0", "actor.train", tp, pp, tuple(range(n)))
        dst = UnitMeta("a#1", "actor.train", tp, pp, tuple(range(n, 2 * n)))
        mv = MoveSpec("extend", "extend", "actor.train", produces=(dst,), sources=(src,), kinds=KINDS)
        out.append((name, spec, mv, (0, n - 1, n, 2 * n - 1)))

    def split(name, spec, tp, pp):
        n = tp * pp
        src = UnitMeta("a#0", "actor.train", tp, pp, tuple(range(n)))
        half = [tuple(p * tp + t for p in range(pp) for t in range(tp) if t % 2 == k) for k in (0, 1)]
        prod = tuple(UnitMeta(f"a#0/s{k}", "actor.train", tp // 2, pp, g) for k, g in enumerate(half))
        mv = MoveSpec("split", "split", "actor.train", consumes=(src.uid,), produces=prod, sources=(src,),
                      local=(src,), kinds=KINDS)
        out.append((name, spec, mv, (0, 1, n - 2, n - 1)))

    def merge(name, spec, pp):
        one = UnitMeta("u", "actor.train", 1, pp, tuple(range(pp)))
        tgt = UnitMeta("t", "actor.train", pp, 1, tuple(range(pp)))
        mv = MoveSpec("merge", "merge", "actor.train", consumes=("u",), produces=(tgt,), sources=(one,),
                      local=(one,), kinds=KINDS)
        out.append((name, spec, mv, (0, pp - 1)))

    extend("llama-3.1-8b tp1 extend", s8, 1, 1)
    split("llama-3.1-8b tp2 pp2 split", s8, 2, 2)
    merge("llama-3.1-8b pp2 -> tp2 merge", s8, 2)
    split("llama-3.3-70b tp8 pp8 split", s70, 8, 8)
    extend("llama-3.3-70b tp4 pp16 extend", s70, 4, 16)  # last: the headline case
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the per-worker records here")
    args = ap.parse_args(argv)
    report = {}
    for name, spec, move, workers in cases():
        recs = [run_worker(spec, move, w) for w in workers]
        worst = max(recs, key=lambda r: r["total_s"])
        report[name] = {"workers": recs, "s_per_worker": worst["total_s"]}
        print(f"  {name}: plan {worst['plan_s']:.3f}s, pack {worst['pack_s']:.3f}s, assemble "
              f"{worst['assemble_s']:.3f}s (worker {worst['worker']}; sends {max(r['sent'] for r in recs) / 1e9:.2f} GB, "
              f"receives {max(r['recv'] for r in recs) / 1e9:.2f} GB per worker, {max(r['pieces'] for r in recs)} pieces)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    for name, r in report.items():
        print(f"{name}: {r['s_per_worker']:.3f} s per worker")
    return report


if __name__ == "__main__":
    main()
