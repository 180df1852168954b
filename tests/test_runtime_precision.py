"""Mixed precision as Megatron-LM runs it (``worker/engine.py``, ``--precision bf16``): bf16 weights and
compute, fp32 master weights, fp32 gradient accumulation and fp32 Adam moments; the byte counts the
planners see (``device_model.runtime_job``) and the state kinds a live transition moves (``transit/plans.py``).

Single-process tests (a layout of one worker needs no communicator); the distributed parts are in
tests/test_runtime_executor.py (a live transition in bf16) and tests/test_runtime_durable.py."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")

from nereus.runtime.comm.instrument import Meter  # noqa: E402
from nereus.runtime.comm.parallel import Layout, build_context  # noqa: E402
from nereus.runtime.model.precision import TRAIN_KINDS, train_kinds, workload_bytes  # noqa: E402
from nereus.runtime.run.config import RLConfig  # noqa: E402
from nereus.runtime.run.device_model import runtime_job  # noqa: E402
from nereus.runtime.transit.plans import kind_dtype, kinds_for  # noqa: E402
from nereus.runtime.worker.device import resolve_dtype  # noqa: E402
from nereus.runtime.worker.engine import AdamConfig, Engine  # noqa: E402
from nereus.spec.presets import MODEL_PRESETS  # noqa: E402
from nereus.spec.workload import WorkloadSpec  # noqa: E402
from nereus.transition.emu import state_bytes_per_param  # noqa: E402

SPEC = MODEL_PRESETS["tiny"]
#: bf16 has an 8-bit significand: one rounding is a relative error of at most 2^-9 = 0.2%. A forward
#: and backward through the tiny model's layers compounds many roundings; measured on this model and
#: batch (the bf16 run against the fp32 run from the same seed): loss 4.9e-5 relative, gradients
#: 0.88% (relative L2 over all parameters), the weight change of three PPO updates 5.2% (relative L2;
#: Adam's first steps are close to ``lr * sign(g)``, so elements whose gradient is near zero flip
#: sign under bf16 noise, 11% after one update, and the gap shrinks as the moments fill). The
#: bounds leave 2-20x headroom over those measurements.
LOSS_RTOL, GRAD_RTOL, UPDATE_RTOL = 1e-3, 3e-2, 0.1


def _engine(precision: str, lr: float = 1e-3, trainable: bool = True) -> Engine:
    m = Meter()
    ctx = build_context(SPEC, Layout(1, 1, 1, (0,)), 0, None, f"t/{precision}", m)
    return Engine(SPEC, ctx, 0, m, trainable, AdamConfig(lr=lr), precision=precision)


def _rel(a: dict, b: dict) -> float:
    """Relative L2 distance ``||a - b|| / ||b||`` over every tensor of two name → tensor dicts."""
    num = sum(float((a[n].float() - b[n].float()).pow(2).sum()) for n in b)
    return (num / sum(float(b[n].float().pow(2).sum()) for n in b)) ** 0.5


def _batch(e32: Engine, P: int = 4, R: int = 8, n: int = 4) -> dict:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(3, SPEC.vocab_size, (n, P + R), generator=g)
    with torch.no_grad():
        old = e32.logprobs(tokens, P, 2)
    return {"tokens": tokens, "mask": torch.ones(n, R), "old_logp": old,
            "adv": torch.randn(n, R, generator=g)}


def test_bf16_engine_holds_bf16_weights_fp32_master_and_moments():
    e = _engine("bf16")
    kinds = e.state_tensors()
    assert tuple(kinds) == TRAIN_KINDS == train_kinds("bf16")
    for kind, tensors in kinds.items():
        for n, t in tensors.items():
            assert t.dtype == (torch.bfloat16 if kind == "params" else torch.float32), (kind, n)
    for n, w in e.model.params.items():  # the weights are the master rounded to bf16
        assert torch.equal(w.detach(), kinds["master"][n].to(torch.bfloat16)), n
    n_params = sum(w.numel() for w in e.model.params.values())
    assert e.state_bytes == n_params * (2 + 4 + 8)  # the cost model's 2 + 12 bytes per trained parameter
    assert _engine("fp32").state_bytes == n_params * (4 + 8)
    frozen = _engine("bf16", trainable=False)
    assert list(frozen.state_tensors()) == ["params"] and frozen.state_bytes == n_params * 2


def test_bf16_training_step_matches_fp32_reference_within_bf16_tolerance():
    e32, e16 = _engine("fp32"), _engine("bf16")
    w0 = {n: w.detach().clone() for n, w in e32.model.params.items()}
    m0 = {n: m.clone() for n, m in e16.master.items()}  # the bf16-rounded initial weights
    batch = _batch(e32)
    loss = {"kind": "actor", "prompt_len": 4, "clip": 0.2}
    denom = float(batch["mask"].sum())
    # gradients (fp32 main gradients of the bf16 run) against the fp32 run's
    l32, l16 = e32.backward_lm(batch["tokens"], 2, denom), e16.backward_lm(batch["tokens"], 2, denom)
    assert abs(l16 - l32) <= LOSS_RTOL * abs(l32)
    g16 = e16.grads()
    assert all(g.dtype == torch.float32 for g in g16.values())
    assert _rel(g16, e32.grads()) < GRAD_RTOL
    # three PPO updates: the bf16 run's master moves as the fp32 run's weights do
    for k in range(3):
        m32 = e32.train_step(batch, loss, 2, denom, k + 1)
        m16 = e16.train_step(batch, loss, 2, denom, k + 1)
        assert abs(m16["loss"] - m32["loss"]) <= LOSS_RTOL + LOSS_RTOL * abs(m32["loss"]), k
    d32 = {n: w.detach() - w0[n] for n, w in e32.model.params.items()}
    d16 = {n: e16.master[n] - m0[n] for n in w0}
    assert _rel(d16, d32) < UPDATE_RTOL  # the weight change itself, not the weights
    for n, w in e16.model.params.items():
        assert torch.equal(w.detach(), e16.master[n].to(torch.bfloat16)), n
    assert e16.main_grad is None  # fp32 main gradients are transient


def test_fp32_master_accumulates_updates_below_bf16_resolution():
    """Hand-built: every weight 1.0 and a constant gradient 1. Adam's step is then lr / (1 + eps)
    each update, 1e-3 here, under bf16's resolution at 1.0 (ulp 2^-8 = 0.0039 below 1.0, so an
    update under 2^-9 rounds back to 1.0). Pure bf16 weights never move; the fp32 master moves by
    1e-3 per step, and the bf16 weights follow once the master crosses a rounding boundary."""
    lr = 1e-3
    e = _engine("bf16", lr=lr)
    with torch.no_grad():
        for n, w in e.model.params.items():
            e.master[n].fill_(1.0)
            w.fill_(1.0)
    assert torch.tensor(1.0, dtype=torch.bfloat16) - lr == 1.0  # pure bf16 update: lost
    expect = 1.0
    for k in range(1, 6):
        e.main_grad = {n: torch.ones_like(m) for n, m in e.master.items()}
        e._adam_step()
        e.main_grad = None
        expect -= lr / (1 + 1e-8)  # m_hat = v_hat = 1 for a constant gradient
        for n, w in e.model.params.items():
            assert torch.allclose(e.master[n], torch.full_like(e.master[n], expect), atol=1e-6), (k, n)
            want = torch.tensor(expect, dtype=torch.float32).to(torch.bfloat16)
            assert torch.equal(w.detach(), torch.full_like(w.detach(), want.item())), (k, n)
        first = float(next(iter(e.model.params.values())).detach().flatten()[0])
        # bf16 spacing just below 1.0 is 2^-8, the midpoint 1 - 2^-9 = 0.998046875: the master's
        # 0.999 after one update rounds back to 1.0; 0.998 .. 0.995 round to 0.99609375 = 1 - 2^-8
        assert first == (1.0 if k == 1 else 1 - 2 ** -8), (k, first)


def test_runtime_job_counts_the_bytes_each_precision_holds():
    w = WorkloadSpec(algorithm="grpo", prompts_per_step=4, samples_per_prompt=2, prompt_len=5, response_len=4,
                     mini_batch_size=4, micro_batch_size=1)
    jobs = {"fp32": runtime_job(SPEC, w, 4), "bf16": runtime_job(SPEC, w, 4, precision="bf16")}
    fp32, bf16 = jobs["fp32"].workload, jobs["bf16"].workload
    assert (fp32.param_bytes, fp32.kv_bytes, fp32.optimizer_bytes, fp32.grad_bytes) == (4, 4, 8, 4)
    assert (bf16.param_bytes, bf16.kv_bytes, bf16.optimizer_bytes, bf16.grad_bytes) == (2, 2, 12, 4)
    # the transition planner's bytes per parameter of a training EMU = what a unit of that EMU holds
    for prec, job in jobs.items():
        held = sum(torch.empty((), dtype=kind_dtype(k, torch.bfloat16 if prec == "bf16" else torch.float32))
                   .element_size() for k in train_kinds(prec))
        assert state_bytes_per_param(job, "actor.train") == held == workload_bytes(prec)["param_bytes"] + \
            workload_bytes(prec)["optimizer_bytes"]
    with pytest.raises(ValueError, match="precision"):
        runtime_job(SPEC, w, 4, precision="fp16")


def test_kinds_dtypes_and_config_validation():
    assert kinds_for(TRAIN_KINDS, "fp32") == ("params", "exp_avg", "exp_avg_sq")
    assert kinds_for(TRAIN_KINDS, "bf16") == TRAIN_KINDS
    assert kinds_for(("params",), "bf16") == ("params",)
    assert resolve_dtype("auto", True, "cpu", "bf16") == torch.bfloat16
    assert resolve_dtype("auto", True, "cpu", "fp32") == torch.float32
    with pytest.raises(ValueError, match="precision"):
        resolve_dtype("auto", True, "cpu", "fp8")
    with pytest.raises(ValueError, match="precision"):
        RLConfig(precision="fp16")
    assert RLConfig().precision == "fp32"
    assert RLConfig(precision=None).precision == ("bf16" if torch.cuda.is_available()
                                                  and torch.cuda.is_bf16_supported() else "fp32")
    with pytest.raises(ValueError, match="precision"):
        _engine("fp16")
