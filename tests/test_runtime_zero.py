"""ZeRO-1 training steps equal plain DP (fp32 reduction tolerance), composed with TP and PP, in fp32 and
bf16; the optimizer state is 1/dp per rank and the gradient reduce is a reduce-scatter of the bytes
the formula gives (``worker/zero.py``). Four local worker processes (``run/local.py``), no Ray.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")

from nereus.runtime.comm.parallel import Layout  # noqa: E402
from nereus.runtime.run.local import run_local  # noqa: E402
from nereus.runtime.worker.engine import AdamConfig  # noqa: E402
from nereus.spec.presets import MODEL_PRESETS  # noqa: E402

SPEC = MODEL_PRESETS["tiny"]
N, T, P, MB = 8, 9, 5, 1
# (tp, pp, dp), precision
CASES = [((1, 1, 2), "fp32"), ((1, 1, 4), "fp32"), ((2, 1, 2), "fp32"), ((1, 2, 2), "bf16")]
LOSS = {"kind": "actor", "prompt_len": P, "clip": 0.2, "kl_coef": 0.0, "temperature": 1.0}
EPS = 1e-3  # Adam eps large enough that an fp32 reduction-order error stays small (test_runtime_parallel)


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    R = T - P
    return {"tokens": torch.randint(3, SPEC.vocab_size, (N, T), generator=g), "mask": torch.ones(N, R),
            "old_logp": -torch.rand(N, R, generator=g), "adv": torch.randn(N, R, generator=g)}


def _rank_main(core, ckpt_dir):
    from nereus.runtime.comm.groups import new_group

    new_group(core.store, "z/warm", (0, 1, 2, 3), core.id, core.meter, timeout_s=120.0).all_reduce(torch.ones(1))
    out = {}
    for i, ((tp, pp, dp), prec) in enumerate(CASES):
        n = tp * pp * dp
        if core.id >= n:
            continue
        lay = Layout(tp, pp, dp, tuple(range(n)))
        res = {}
        for zero in (0, 1):
            name = f"c{i}z{zero}"
            d, p, t = core.build(name, SPEC, lay, 0, True, AdamConfig(lr=1e-2, eps=EPS), tag=f"z{i}",
                                 precision=prec, zero=zero)
            core.reset_measurements()
            for step in range(2):
                b = _batch(step)
                denom = float(b["mask"].sum())
                core.train(name, {k: v.chunk(dp)[d] for k, v in b.items()}, LOSS, MB, denom, step + 1)
            m = core.measurements()
            e = core.engines[name]
            state = core.gather_logical_state(name)  # every replica calls it (ZeRO all-gathers over DP)
            if zero:  # a DCP checkpoint of the ZeRO engine, loaded into a plain and a ZeRO engine
                from nereus.runtime.durable.worker_side import load_engine

                path = os.path.join(ckpt_dir, f"c{i}")
                core.dcp_save([name], path)  # replica 0 writes; the other replicas join its all-gathers
                new_group(core.store, f"z/bar{i}", tuple(range(n)), core.id, core.meter).all_reduce(torch.ones(1))
                for z2 in (0, 1):
                    core.build(f"l{i}z{z2}", SPEC, lay, 5, True, AdamConfig(lr=1e-2, eps=EPS), tag=f"l{i}",
                               precision=prec, zero=z2)
                    load_engine(core.engines[f"l{i}z{z2}"], os.path.join(path, name))
                    loaded = core.gather_logical_state(f"l{i}z{z2}")
                    if core.id == 0:
                        res[f"loaded{z2}"] = loaded
                    core.destroy(f"l{i}z{z2}")
            res[zero] = {"state": state if core.id == 0 else None, "bytes": e.state_bytes,
                         "numel": sum(w.numel() for w in e.model.params.values()),
                         "rs_s": m["op_seconds"].get("reducescatter@gloo", 0.0),
                         "ag_s": m["op_seconds"].get("allgather@gloo", 0.0), "sent": m["bytes_sent"]}
            core.destroy(name)
        out[i] = res
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_local(4, _rank_main, (str(tmp_path_factory.mktemp("zero")),), timeout_s=400, group_timeout_s=30)


def _maxdiff(a, b):
    return float((a.float() - b.float()).abs().max())


@pytest.mark.parametrize("case", range(len(CASES)))
def test_zero1_equals_plain_dp(results, case):
    (tp, pp, dp), prec = CASES[case]
    plain, z = results[0][case][0]["state"], results[0][case][1]["state"]
    for k in ("step", "update_count", "position"):
        assert plain[k] == z[k] == 2
    kinds = ["params", "exp_avg", "exp_avg_sq"] + (["master"] if prec == "bf16" else [])
    for kind in kinds:
        assert set(plain[kind]) == set(z[kind])
        for n in plain[kind]:
            scale = max(1.0, float(plain[kind][n].abs().max()))
            tol = 2e-5 if prec == "fp32" else 1e-2  # bf16 weights: one rounding step of a near-tie
            assert _maxdiff(plain[kind][n], z[kind][n]) <= tol * scale, (case, kind, n)
    if dp == 2:  # a sum of two is the same either way: bit-equal, every kind
        for kind in kinds:
            for n in plain[kind]:
                assert torch.equal(plain[kind][n], z[kind][n]), (kind, n)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_zero1_shards_optimizer_state_and_reduce_scatters(results, case):
    (tp, pp, dp), prec = CASES[case]
    for r in results:
        if case not in r:
            continue
        plain, z = r[case][0], r[case][1]
        numel = plain["numel"]
        k = -(-numel // dp)  # padded slice
        w = 4 if prec == "fp32" else 2
        opt = 8 if prec == "fp32" else 12  # two fp32 moments (+ the fp32 master under bf16)
        assert plain["bytes"] == numel * (w + opt)
        assert z["bytes"] == numel * w + k * opt
        assert z["rs_s"] > 0 and plain["rs_s"] == 0
        # bytes sent per step in the DP group, by formula: plain all-reduce 2(n-1)/n·4N; ZeRO-1
        # reduce-scatter (n-1)/n·4·dp·k plus the all-gather of the updated weights (n-1)·k·w
        plain_dp = 2 * (dp - 1) / dp * 4 * numel
        zero_dp = (dp - 1) / dp * 4 * dp * k + (dp - 1) * k * w
        assert z["sent"] - plain["sent"] == pytest.approx(2 * (zero_dp - plain_dp), rel=1e-9)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_zero1_dcp_checkpoint_restores_into_plain_and_zero(results, case):
    """The checkpoint holds the unsliced state: a plain and a ZeRO-1 engine loaded from it gather the
    saved state bit for bit."""
    saved = results[0][case][1]["state"]
    for z2 in (0, 1):
        got = results[0][case][f"loaded{z2}"]
        for kind in ("params", "exp_avg", "exp_avg_sq") + (("master",) if "master" in saved else ()):
            for n, t in saved[kind].items():
                assert torch.equal(got[kind][n], t), (z2, kind, n)
        for k in ("step", "update_count", "position"):
            assert got[k] == saved[k]
