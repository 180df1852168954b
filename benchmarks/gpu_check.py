"""GPU check of the runtime: TP/PP parity and one live transition on the CUDA devices present.

    python benchmarks/gpu_check.py            # exits 0 with a message when there is no CUDA device

What it runs (each worker one CUDA device, ``worker.select_device``; groups are NCCL when torch has
it, ``comm.backend_for``):

1. **Parity** (``run_local``, one process per device, up to 4): logits and gradients of the tiny
   model under every (tp, pp) with ``tp * pp`` <= the device count, against layout (1, 1, 1) on one
   device and against the same model on the CPU (fp32, TF32 off). Prints the max abs differences;
   fails above 1e-4 (logits) and 1e-5 (gradients) (the CPU tests measure 2.4e-7 and 5.4e-8; CUDA
   kernels reduce in another order).
2. **bf16 step**: one ``backward_lm`` in ``precision="bf16"`` against fp32 on device 0; prints the
   loss and gradient relative errors (tests/test_runtime_precision.py bounds them at 1e-3, 3e-2).
3. **Live transition** (Ray, one actor per GPU, needs >= 2 devices): a PPO step, then actor.train
   TP 2 -> 1 (a Split: each worker gathers the other's half) through the executor, in fp32 and bf16; prints its report and checks the gathered state is
   bit-for-bit unchanged and the bytes moved equal the planner's.

4. **Communicator split** (``run_local``, one process per device, needs >= 2): the member sets of a
   few transitions (pairs, halves, all) built as ``new_group`` among their members against
   ``GroupCache.split`` from a job-wide communicator (``comm/split.py``: every worker takes part,
   non-members pass no color); prints the seconds per member set of each and checks an
   all-reduce on every split group gives the members' sum.

With one device NCCL cannot run (a communicator needs distinct devices), so parts 1 and 3 are
skipped with a message and only the single-device checks run.
"""

from __future__ import annotations

import os
import sys
import time

import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

SEQ, BATCH = 10, 4


def _layouts(n: int) -> list[tuple[int, int]]:
    return [(tp, pp) for tp, pp in ((1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4)) if tp * pp <= n]


def _parity_worker(core, layouts, tokens):
    """On every worker: logits and gradients (gathered full) of each layout it is part of."""
    from nereus.runtime.comm.parallel import Layout
    from nereus.spec.presets import MODEL_PRESETS

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    spec = MODEL_PRESETS["tiny"]
    out = {"device": core.device, "backend": None}
    for tp, pp in layouts:
        if core.id >= tp * pp:
            continue
        name = f"par{tp}{pp}"
        core.build(name, spec, Layout(tp, pp, 1, tuple(range(tp * pp))), seed=0, trainable=True, tag=name)
        e = core.engines[name]
        out["backend"] = e.ctx.tp_group.backend if tp > 1 else e.ctx.emu_group.backend
        logits = e.forward(tokens.to(core.device), BATCH)
        e.backward_lm(tokens.to(core.device), BATCH, float(tokens.numel()))
        grads = e.gather_full("grads")
        if core.id == (pp - 1) * tp:  # last PP stage, TP rank 0 holds the logits
            out[(tp, pp)] = {"logits": logits.cpu(), "grads": grads}
        elif core.id == 0 and (tp, pp) not in out:
            out[(tp, pp)] = {"grads": grads}
        core.destroy(name)
    return out


def parity(n: int) -> bool:
    from nereus.runtime.comm.instrument import Meter
    from nereus.runtime.comm.parallel import Layout, build_context
    from nereus.runtime.run.local import run_local
    from nereus.runtime.worker.engine import AdamConfig, Engine
    from nereus.spec.presets import MODEL_PRESETS

    spec = MODEL_PRESETS["tiny"]
    tokens = torch.randint(3, spec.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    # CPU reference: the same model on one CPU worker
    m = Meter()
    cpu = Engine(spec, build_context(spec, Layout(1, 1, 1, (0,)), 0, None, "cpu", m), 0, m, True, AdamConfig())
    ref_logits = cpu.forward(tokens, BATCH)
    cpu.backward_lm(tokens, BATCH, float(tokens.numel()))
    ref_grads = cpu.gather_full("grads")
    layouts = _layouts(min(n, 4))
    res = run_local(min(n, 4), _parity_worker, (layouts, tokens), timeout_s=600)
    ok = True
    print(f"parity: {min(n, 4)} workers on {[r['device'] for r in res]}, groups {res[0]['backend']}")
    for lay in layouts:
        got = next(r[lay] for r in res if lay in r and "logits" in r[lay])
        grads = next(r[lay]["grads"] for r in res if lay in r)
        dl = float((got["logits"] - ref_logits).abs().max())
        dg = max(float((grads[k].cpu() - ref_grads[k]).abs().max()) for k in ref_grads)
        good = dl < 1e-4 and dg < 1e-5
        ok &= good
        print(f"  (tp, pp) = {lay}: logits max |diff| {dl:.2e}, gradients {dg:.2e}  {'ok' if good else 'FAIL'}")
    return ok


def bf16_step() -> bool:
    from nereus.runtime.comm.instrument import Meter
    from nereus.runtime.comm.parallel import Layout, build_context
    from nereus.runtime.worker.engine import AdamConfig, Engine
    from nereus.spec.presets import MODEL_PRESETS

    spec = MODEL_PRESETS["tiny"]
    tokens = torch.randint(3, spec.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0)).cuda()
    res = {}
    for prec in ("fp32", "bf16"):
        m = Meter()
        ctx = build_context(spec, Layout(1, 1, 1, (0,)), 0, None, prec, m, device="cuda:0")
        e = Engine(spec, ctx, 0, m, True, AdamConfig(), device="cuda:0", precision=prec)
        loss = e.backward_lm(tokens, 2, float(tokens.numel()))
        res[prec] = (loss, {k: g.float().cpu() for k, g in e.grads().items()})
    (l32, g32), (l16, g16) = res["fp32"], res["bf16"]
    num = sum(float((g16[k] - g32[k]).pow(2).sum()) for k in g32)
    rel = (num / sum(float(g.pow(2).sum()) for g in g32.values())) ** 0.5
    dl = abs(l16 - l32) / abs(l32)
    ok = dl < 1e-3 and rel < 3e-2
    print(f"bf16 step on cuda:0: loss rel diff {dl:.2e}, gradient rel L2 {rel:.2e}  {'ok' if ok else 'FAIL'}")
    return ok


def transition(n: int) -> bool:
    import ray

    from nereus.runtime.rl.task import DigitTask
    from nereus.runtime.run.config import RLConfig
    from nereus.runtime.run.device_model import runtime_job
    from nereus.runtime.run.driver import RLDriver
    from nereus.runtime.run.pool import WorkerPool
    from nereus.runtime.transit.driver_side import TransitionExecutor
    from nereus.spec.plan import Candidate, Plan
    from nereus.spec.presets import MODEL_PRESETS
    from nereus.spec.workload import WorkloadSpec
    from nereus.transition.estimate import estimate_transition

    spec = MODEL_PRESETS["tiny"]
    w = WorkloadSpec(algorithm="grpo", prompts_per_step=4, samples_per_prompt=2, prompt_len=5, response_len=4,
                     mini_batch_size=4, micro_batch_size=1, infer_micro_batch_size=4, reward_model=False)
    lay = {"actor.generate": (1, 1, 1, (0,)), "actor.infer": (1, 1, 1, (0,)), "reference.infer": (1, 1, 1, (1,)),
           "actor.train": (2, 1, 1, (0, 1))}

    def plan(**ch):
        d = {**lay, **{k.replace("_", "."): v for k, v in ch.items()}}
        return Plan(candidates=tuple(Candidate(ms, tp, pp, dp, micro_batch=0 if ms.endswith("generate") else 1,
                                               gpus=g) for ms, (tp, pp, dp, g) in d.items()))

    ray.init(num_gpus=n, include_dashboard=False, log_to_driver=False)
    pool = WorkerPool(2, timeout_s=60).start()
    ok = True
    try:
        for prec in ("fp32", "bf16"):
            d = RLDriver(spec, w, plan(), DigitTask("reverse", 3), 2, RLConfig(precision=prec)).start(pool)
            try:
                d.step()
                before = d.gather_logical_state("actor.train")
                target = plan(actor_train=(1, 1, 1, (0,)))
                est = estimate_transition(runtime_job(spec, w, 2, precision=prec),
                                          Plan(candidates=tuple(d.cands.values())), target, frozenset((0, 1)))
                t0 = time.perf_counter()
                rep = TransitionExecutor(d).execute(est, target)
                secs = time.perf_counter() - t0
                after = d.gather_logical_state("actor.train")
                same = all(torch.equal(after[k][n_], before[k][n_]) for k in ("params", "master", "exp_avg",
                                                                              "exp_avg_sq") if k in before
                           for n_ in before[k])
                good = same and rep.bytes_moved == rep.predicted_bytes
                ok &= good
                print(f"live transition ({prec}) actor.train TP 2 -> 1 on devices: {rep.summary()}; "
                      f"{secs:.2f}s; state bit-for-bit {same}; bytes {rep.bytes_moved} vs planned "
                      f"{rep.predicted_bytes}  {'ok' if good else 'FAIL'}")
                d.step()
            finally:
                d.close()
    finally:
        pool.close()
        ray.shutdown()
    return ok


def _split_worker(core, sets):
    """On every worker: seconds of ``new_group`` per member set (members only) and of
    ``GroupCache.split`` (every worker), and an all-reduce on each split group."""
    from nereus.runtime.comm.cache import GroupCache
    from nereus.runtime.comm.groups import new_group
    from nereus.runtime.comm.split import SplitRegistry

    dev, n = core.device, len(sets[-1])
    t0 = time.perf_counter()
    for i, m in enumerate(sets):  # one after another in the same order on every worker
        if core.id in m:
            g = new_group(core.store, f"gc/new{i}", m, core.id, core.meter, core.timeout_s, dev)
            g.all_reduce(torch.ones(1, device=dev))  # NCCL initialises lazily: the first collective
    t_new = time.perf_counter() - t0
    cache = GroupCache(core.store, core.id, core.meter, core.timeout_s)
    todo = SplitRegistry().plan(range(n), sets)
    t_split = cache.split(range(n), todo, "gc/split", dev)
    sums = {m: float(cache.get(m, "unused", dev)[0].all_reduce(torch.full((1,), float(core.id + 1), device=dev)))
            for m in todo if core.id in m}
    return {"new_s": t_new, "split_s": t_split, "sums": sums, "reused": cache.reused}


def split_check(n: int) -> bool:
    from nereus.runtime.run.local import run_local

    k = min(n, 8)
    sets = [tuple(range(i, i + 2)) for i in range(0, k - 1, 2)] + [tuple(range(k // 2)), tuple(range(k))]
    sets = list(dict.fromkeys(s for s in sets if len(s) >= 2))
    res = run_local(k, _split_worker, (sets,), timeout_s=300)
    ok = all(r["sums"][m] == sum(w + 1 for w in m) for r in res for m in r["sums"]) and all(
        r["reused"] == len(r["sums"]) for r in res)
    new, split = max(r["new_s"] for r in res), max(r["split_s"] for r in res)
    print(f"communicator split on {k} devices, member sets {sets}: new_group {new:.3f}s "
          f"({new / len(sets):.3f}s a set), split from a job-wide parent {split:.3f}s "
          f"({split / len(sets):.3f}s a set, the parent's init included); all-reduce sums "
          f"{'ok' if ok else 'FAIL'}")
    return ok


def main() -> int:
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        print("gpu_check: no CUDA device here; nothing to check (the CPU path is covered by the tests)")
        return 0
    n = torch.cuda.device_count()
    print(f"gpu_check: {n} CUDA device(s): {[torch.cuda.get_device_name(i) for i in range(n)]}; "
          f"NCCL {'available' if torch.distributed.is_nccl_available() else 'absent'}")
    ok = bf16_step()
    if n >= 2:
        ok &= parity(n)
        ok &= transition(n)
        ok &= split_check(n)
    else:
        print("parity and live transition need >= 2 CUDA devices (an NCCL communicator needs distinct "
              "devices); skipped")
    print("gpu_check:", "all ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
