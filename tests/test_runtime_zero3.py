"""ZeRO-2 and ZeRO-3 training steps equal plain DP, composed with TP and PP, in fp32 and bf16; ZeRO-3
inference passes equal plain ones; state and collective bytes per step equal the formulas of
``worker/zero3.py``; DCP checkpoints round-trip between ZeRO-3, ZeRO-1 and plain engines; the
accounted peak never exceeds the capacity. Four local worker processes (``run/local.py``), no Ray.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")

from nereus.runtime.comm.parallel import Layout  # noqa: E402
from nereus.runtime.run.local import run_local  # noqa: E402
from nereus.runtime.worker.engine import AdamConfig  # noqa: E402
from nereus.runtime.worker.zero3 import unit_names  # noqa: E402
from nereus.spec.presets import MODEL_PRESETS  # noqa: E402

SPEC = MODEL_PRESETS["tiny"]
VSPEC = replace(SPEC, head="value")
N, T, P = 8, 9, 5
# (tp, pp, dp), precision, micro-batch (N/dp rows per replica: one micro-batch makes the sums bit-equal)
CASES = [((1, 1, 2), "fp32", 4), ((1, 1, 2), "fp32", 1), ((1, 1, 4), "fp32", 1), ((2, 1, 2), "fp32", 2),
         ((1, 2, 2), "bf16", 2), ((1, 2, 2), "fp32", 4)]
LOSS = {"kind": "actor", "prompt_len": P, "clip": 0.2, "kl_coef": 0.0, "temperature": 1.0}
EPS = 1e-3
STEPS = 2


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    R = T - P
    return {"tokens": torch.randint(3, SPEC.vocab_size, (N, T), generator=g), "mask": torch.ones(N, R),
            "old_logp": -torch.rand(N, R, generator=g), "adv": torch.randn(N, R, generator=g)}


def _rank_main(core, ckpt_dir):
    from nereus.runtime.comm.groups import new_group
    from nereus.runtime.durable.worker_side import load_engine

    new_group(core.store, "z3/warm", (0, 1, 2, 3), core.id, core.meter, timeout_s=120.0).all_reduce(torch.ones(1))
    out = {}
    for i, ((tp, pp, dp), prec, mb) in enumerate(CASES):
        n = tp * pp * dp
        if core.id >= n:
            continue
        lay = Layout(tp, pp, dp, tuple(range(n)))
        bar = new_group(core.store, f"z3/bar{i}", tuple(range(n)), core.id, core.meter)
        res = {}
        for zero in (0, 2, 3):
            name = f"c{i}z{zero}"
            d, p, t = core.build(name, SPEC, lay, 0, True, AdamConfig(lr=1e-2, eps=EPS), tag=f"z3{i}",
                                 precision=prec, zero=zero)
            e = core.engines[name]
            core.reset_measurements()
            for step in range(STEPS):
                b = _batch(step)
                core.train(name, {k: v.chunk(dp)[d] for k, v in b.items()}, LOSS, mb, float(b["mask"].sum()),
                           step + 1)
            m = core.measurements()
            state = core.gather_logical_state(name)
            res[zero] = {"state": state if core.id == 0 else None, "bytes": e.state_bytes,
                         "names": list(e.model.names), "sent": m["bytes_sent"], "peak": m["peak_bytes"],
                         "layout": e.layout() if zero else None}
            if zero == 3:  # checkpoint of ZeRO-3 into plain, ZeRO-1 and ZeRO-3 engines
                path = os.path.join(ckpt_dir, f"c{i}")
                core.dcp_save([name], path)
                bar.all_reduce(torch.ones(1))
                for z2 in (0, 1, 3):
                    ln = f"l{i}z{z2}"
                    core.build(ln, SPEC, lay, 5, True, AdamConfig(lr=1e-2, eps=EPS), tag=f"l{i}", precision=prec,
                               zero=z2)
                    load_engine(core.engines[ln], os.path.join(path, name))
                    got = core.gather_logical_state(ln)
                    res[f"loaded{z2}"] = got if core.id == 0 else None
                    if z2 == 0:  # and back: the plain engine's checkpoint into a fresh ZeRO-3 engine
                        back = os.path.join(ckpt_dir, f"b{i}")
                        core.dcp_save([ln], back)
                        bar.all_reduce(torch.ones(1))
                        core.build(f"r{i}", SPEC, lay, 7, True, AdamConfig(lr=1e-2, eps=EPS), tag=f"r{i}",
                                   precision=prec, zero=3)
                        load_engine(core.engines[f"r{i}"], os.path.join(back, ln))
                        got = core.gather_logical_state(f"r{i}")
                        res["back3"] = got if core.id == 0 else None
                        core.destroy(f"r{i}")
                    core.destroy(ln)
                # the re-layout through the driver: logical state loaded into a fresh ZeRO-3 engine
                core.build(f"g{i}", SPEC, lay, 9, True, AdamConfig(lr=1e-2, eps=EPS), tag=f"g{i}", precision=prec,
                           zero=3)
                core.load_logical_state(f"g{i}", state)
                got = core.gather_logical_state(f"g{i}")
                res["relayout"] = got if core.id == 0 else None
                core.destroy(f"g{i}")
            core.destroy(name)
        # ZeRO-3 inference: log-probs (LM head) and values (value head) equal the plain engines'
        toks = _batch(99)["tokens"].chunk(dp)[d]
        inf = {}
        for zero in (0, 3):
            core.build(f"i{i}z{zero}", SPEC, lay, 3, False, tag=f"i{i}{zero}", dtype="float32", precision=prec,
                       zero=zero)
            core.build(f"v{i}z{zero}", VSPEC, lay, 4, False, tag=f"v{i}{zero}", dtype="float32", precision=prec,
                       zero=zero)
            inf[zero] = (core.logprobs(f"i{i}z{zero}", toks, P, mb), core.values(f"v{i}z{zero}", toks, P, mb))
            core.destroy(f"i{i}z{zero}")
            core.destroy(f"v{i}z{zero}")
        res["inference"] = inf
        out[i] = res
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_local(4, _rank_main, (str(tmp_path_factory.mktemp("zero3")),), timeout_s=600, group_timeout_s=60)


def _close(a, b, prec):
    scale = max(1.0, float(a.abs().max()))
    tol = 2e-5 if prec == "fp32" else 1e-2  # bf16 weights: one rounding step of a near-tie
    return float((a.float() - b.float()).abs().max()) <= tol * scale


def _kinds(prec):
    return ["params", "exp_avg", "exp_avg_sq"] + (["master"] if prec == "bf16" else [])


@pytest.mark.parametrize("zero", (2, 3))
@pytest.mark.parametrize("case", range(len(CASES)))
def test_zero23_equals_plain_dp(results, case, zero):
    (tp, pp, dp), prec, mb = CASES[case]
    plain, z = results[0][case][0]["state"], results[0][case][zero]["state"]
    for k in ("step", "update_count", "position"):
        assert plain[k] == z[k] == STEPS
    bit = dp == 2 and N // dp == mb and tp == 1  # one micro-batch per replica: a sum of two, same order
    for kind in _kinds(prec):
        assert set(plain[kind]) == set(z[kind])
        for n in plain[kind]:
            if bit:
                assert torch.equal(plain[kind][n], z[kind][n]), (kind, n)
            else:
                assert _close(plain[kind][n], z[kind][n], prec), (case, kind, n)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_state_and_collective_bytes_by_formula(results, case):
    """Per rank: ZeRO-2 holds the weights plus ``k_u`` of each unit's optimizer state, ZeRO-3 only
    ``k_u·(w + opt)``; bytes sent per step differ from plain DP by the per-unit reduce-scatters and
    all-gathers of the module docstring (tp = 1: no recomputed TP collectives)."""
    (tp, pp, dp), prec, mb = CASES[case]
    w = 4 if prec == "fp32" else 2
    opt = 8 if prec == "fp32" else 12
    m = (N // dp) // mb
    for r in results:
        if case not in r:
            continue
        res = r[case]
        names = res[0]["names"]
        numel = res[0]["bytes"] // (w + opt)
        units = unit_names(names)
        # k_u by hand from the unit sizes (the layout's own N_u must match)
        lay = {u: (Nu, k) for u, _, Nu, k, _ in res[3]["layout"]}
        assert [u for u, _ in units] == list(lay)
        assert sum(Nu for Nu, _ in lay.values()) == numel
        ks = {u: -(-Nu // dp) for u, (Nu, _) in lay.items()}
        assert ks == {u: k for u, (_, k) in lay.items()}
        K = sum(ks.values())
        assert res[2]["bytes"] == numel * w + K * opt
        assert res[3]["bytes"] == K * (w + opt)
        if tp > 1:
            continue
        plain_dp = 2 * (dp - 1) / dp * 4 * numel
        z2 = m * (dp - 1) * 4 * K + (dp - 1) * K * w
        uses = dict(ks)  # each unit gathered once per forward part; the untied tiny model has no re-use
        z3 = m * sum(2 * (dp - 1) * k * w + (dp - 1) * 4 * k for k in uses.values())
        assert res[2]["sent"] - res[0]["sent"] == pytest.approx(STEPS * (z2 - plain_dp), rel=1e-9)
        assert res[3]["sent"] - res[0]["sent"] == pytest.approx(STEPS * (z3 - plain_dp), rel=1e-9)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_zero3_inference_equals_plain(results, case):
    for r in results:
        if case not in r:
            continue
        (lp0, v0), (lp3, v3) = r[case]["inference"][0], r[case]["inference"][3]
        assert (lp0 is None) == (lp3 is None)
        if lp0 is not None:
            assert torch.equal(lp0, lp3)
            assert torch.equal(v0, v3)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_zero3_checkpoint_round_trips(results, case):
    """A ZeRO-3 DCP checkpoint loads into plain, ZeRO-1 and ZeRO-3 engines, the plain engine's
    checkpoint back into ZeRO-3, and the logical state into a fresh ZeRO-3 engine: bit for bit."""
    (_, _, _), prec, _ = CASES[case]
    saved = results[0][case][3]["state"]
    for key in ("loaded0", "loaded1", "loaded3", "back3", "relayout"):
        got = results[0][case][key]
        for kind in _kinds(prec):
            for n, t in saved[kind].items():
                assert torch.equal(got[kind][n], t), (key, kind, n)
        for k in ("step", "update_count", "position"):
            assert got[k] == saved[k]


def test_zero_bytes_report_formula_by_hand():
    """``memreport.zero_bytes`` per rank: the small model's 4,755,712 parameters per rank (16,384 each
    for the embedding and the head, 256 for the final norm, 8 layers of 590,336; dp 2: k = 2,377,856), fp32 (w = 4), a mini-batch of 32 over dp 2 at micro-batch 4 (m = 4 micro-batches),
    4 updates per step (128 sequences / 32). ZeRO-1: one reduce-scatter of 4·k and one all-gather of
    w·k per update; ZeRO-2: the reduce-scatter per micro-batch; ZeRO-3: two all-gathers per
    micro-batch plus, per step, one per weight sync it sources (actor: generate and infer, spread
    over the 4 updates); a ZeRO-3 infer pass of 128 sequences at micro-batch 4 over dp 2: 16 gathers."""
    from dataclasses import replace as rep

    from nereus.cost.model import CostModel
    from nereus.runtime.run.device_model import runtime_job
    from nereus.runtime.run.memreport import zero_bytes
    from nereus.runtime.run.plans import arrange, simple_plan
    from nereus.spec.workload import WorkloadSpec

    spec = MODEL_PRESETS["small"]
    w = WorkloadSpec(algorithm="ppo", prompts_per_step=32, samples_per_prompt=4, prompt_len=8, response_len=8,
                     mini_batch_size=32, micro_batch_size=4, infer_micro_batch_size=4)
    from nereus.workflow import workflow_for

    lay = {ms.name: (1, 1, 2) if ms.name in ("actor.train", "actor.infer") else (1, 1, 1)
           for ms in workflow_for(w).model_stages}
    base = simple_plan(w, lay, 2, micro_batch=4)
    cost = CostModel(runtime_job(spec, w, 2))
    k = 4_755_712 // 2
    assert w.updates_per_step == 4
    for zero, rs, ag in ((1, 4 * k, 4 * k), (2, 4 * 4 * k, 4 * k), (3, 4 * 4 * k, 2 * 4 * 4 * k + 2 * 4 * k / 4)):
        plan = arrange(base, zero=zero)
        assert zero_bytes(cost, plan, plan["actor.train"]) == (rs, ag), zero
    plan = arrange(base, zero=3)
    assert zero_bytes(cost, plan, plan["actor.infer"]) == (0.0, 16 * 4 * k)
    assert zero_bytes(cost, plan, rep(plan["actor.infer"], zero=0)) == (0.0, 0.0)
