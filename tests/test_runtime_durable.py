"""Checkpoint/restart through torch.distributed.checkpoint (runtime/durable.py): each worker writes
its own shards, a restart in another layout reads only the pieces of each new shard, and the logical
state comes back bit for bit; training continues as without the restart."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")

from nereus.planner.plan import Candidate, Plan  # noqa: E402
from nereus.runtime import durable  # noqa: E402
from nereus.runtime.driver import RLConfig, RLDriver  # noqa: E402
from nereus.runtime.pool import WorkerPool  # noqa: E402
from nereus.runtime.task import DigitTask  # noqa: E402
from nereus.spec.model import MODEL_PRESETS  # noqa: E402
from nereus.spec.workload import WorkloadSpec  # noqa: E402

SPEC = MODEL_PRESETS["tiny"]
TASK = DigitTask("reverse", 3)
W = WorkloadSpec(algorithm="ppo", prompts_per_step=4, samples_per_prompt=2, prompt_len=5, response_len=4,
                 mini_batch_size=4, micro_batch_size=1, infer_micro_batch_size=4, reward_model=False)
CFG = RLConfig(actor_lr=1e-2, critic_lr=1e-2, timeout_s=30)
BASE = {"actor.generate": (1, 1, 2, (0, 1)), "actor.infer": (1, 1, 1, (0,)), "reference.infer": (1, 2, 1, (1, 2)),
        "critic.infer": (1, 1, 1, (3,)), "actor.train": (2, 1, 1, (0, 1)), "critic.train": (1, 2, 1, (2, 3))}
TRAIN = ("actor.train", "critic.train")
KINDS = ("params", "exp_avg", "exp_avg_sq")
COUNTERS = ("step", "update_count", "version", "policy_version", "position")


def plan(**changes) -> Plan:
    lay = {**BASE, **{k.replace("_", "."): v for k, v in changes.items()}}
    return Plan(candidates=tuple(Candidate(ms, tp, pp, dp, micro_batch=1 if not ms.endswith("generate") else 0,
                                           gpus=gpus) for ms, (tp, pp, dp, gpus) in lay.items()))


def test_piece_keys_round_trip():
    for args in (("params", "model.layers.0.self_attn.q_proj.weight", 0, 4, 8),
                 ("exp_avg_sq", "model.layers.3.mlp.down_proj.weight", 1, 0, 64),
                 ("exp_avg", "model.norm.weight", None, 0, 0)):
        assert durable.parse_key(durable.piece_key(*args)) == args
    with pytest.raises(ValueError):
        durable.parse_key("params/x/1:2")


@pytest.fixture(scope="module")
def pool():
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    p = WorkerPool(4, timeout_s=30).start()
    yield p
    p.close()
    if started:
        ray.shutdown()


def _states(d: RLDriver) -> dict:
    return {n: d.gather_logical_state(n) for n in TRAIN}


def _assert_equal(a: dict, b: dict, what: str) -> None:
    for ms in TRAIN:
        for kind in KINDS:
            assert a[ms][kind].keys() == b[ms][kind].keys()
            for n in a[ms][kind]:
                assert torch.equal(a[ms][kind][n], b[ms][kind][n]), (what, ms, kind, n)
        for k in COUNTERS:
            assert a[ms][k] == b[ms][k], (what, ms, k)


def _shard_bytes(d: RLDriver, ms: str) -> int:
    """State bytes every rank of every replica of ``ms`` holds (vocab padding excluded)."""
    from nereus.runtime.layout import names_of_stage, param_shapes
    from nereus.runtime.shards import region

    wf = next(m for m in d.wf.model_stages if m.name == ms)
    spec, lay = d._spec_of(wf.model), d.layouts[ms]
    shapes = param_shapes(spec)
    total = 0
    for _ in range(lay.dp):
        for p in range(lay.pp):
            for t in range(lay.tp):
                for n in names_of_stage(spec, lay.pp, p):
                    shape, r = list(shapes[n][0]), region(spec, n, lay.tp, t)
                    if r.dim is not None:
                        shape[r.dim] = r.hi - r.lo
                    total += 4 * int(torch.Size(shape).numel()) * (3 if wf.trainable else 1)
    return total


@pytest.mark.slow
def test_restart_in_another_layout_keeps_state_bit_for_bit_and_training_continues(pool, tmp_path):
    # reference: two steps without a restart
    ref = RLDriver(SPEC, W, plan(), TASK, 4, CFG).start(pool)
    try:
        ref.step()
        ref.step()
        want = _states(ref)
    finally:
        ref.close()
    d = RLDriver(SPEC, W, plan(), TASK, 4, CFG).start(pool)
    try:
        d.step()
        before = _states(d)
        saved = durable.save(d, str(tmp_path))
        # only replica 0's ranks write, and each writes its own shards: the state bytes of the two
        # training EMUs are their full sizes (params + 2 moments), the frozen/inference copies once
        full = {ms: sum(t.numel() * 4 for kind in KINDS for t in before[ms][kind].values()) for ms in TRAIN}
        assert saved["state"] >= sum(full.values())
        assert saved["written"] >= saved["state"]
        for ms in TRAIN:
            ranks = sorted(os.listdir(tmp_path / ms))
            assert ranks == [f"rank-{w}" for w in d.layouts[ms].replica(0)], (ms, ranks)
        # actor.train TP 2 -> PP 2 and DP 1 -> 2; critic.train PP 2 -> TP 2 on other workers
        target = plan(actor_train=(1, 2, 2, (0, 1, 2, 3)), critic_train=(2, 1, 1, (0, 1)),
                      actor_generate=(2, 1, 1, (2, 3)))
        got = durable.restart(d, str(tmp_path), target)
        assert d.layouts["actor.train"].dp == 2 and d.layouts["actor.train"].pp == 2
        assert d.layouts["critic.train"].tp == 2
        assert got["loaded"] > 0 and got["read"] >= got["loaded"]
        # each new rank copied exactly its shard: the loaded state bytes are the new layouts' sizes
        # (actor.train twice: two replicas)
        if not torch.cuda.is_available():  # fp32 everywhere (a GPU keeps frozen copies in bf16)
            assert got["loaded"] == sum(_shard_bytes(d, ms) for ms in d.layouts)
        _assert_equal(_states(d), before, "restart")
        r1 = d.gather_logical_state("actor.train", 1)
        for kind in KINDS:
            for n, t in before["actor.train"][kind].items():
                assert torch.equal(r1[kind][n], t), ("replica 1", kind, n)
        d.step()
        got_after = _states(d)
    finally:
        d.close()
    for ms in TRAIN:  # same samples, same updates up to fp32 reduction order
        assert got_after[ms]["update_count"] == want[ms]["update_count"]
        assert got_after[ms]["position"] == want[ms]["position"]
        for n in want[ms]["params"]:
            assert torch.allclose(got_after[ms]["params"][n], want[ms]["params"][n], atol=1e-5, rtol=1e-4), (ms, n)


@pytest.mark.slow
def test_bf16_restart_saves_and_loads_every_kind_bit_for_bit(pool, tmp_path):
    """A bf16 run saves bf16 weights, the fp32 master and fp32 moments; a restart in another layout
    reads them back bit for bit, each kind in its own dtype (2 + 4 + 8 bytes per trained parameter)."""
    d = RLDriver(SPEC, W, plan(), TASK, 4, dataclasses.replace(CFG, precision="bf16")).start(pool)
    kinds = KINDS + ("master",)
    try:
        d.step()
        before = _states(d)
        saved = durable.save(d, str(tmp_path))
        n_train = {ms: sum(t.numel() for t in before[ms]["params"].values()) for ms in TRAIN}
        assert saved["state"] >= sum(14 * n for n in n_train.values())
        target = plan(actor_train=(1, 2, 2, (0, 1, 2, 3)), critic_train=(2, 1, 1, (0, 1)),
                      actor_generate=(2, 1, 1, (2, 3)))
        durable.restart(d, str(tmp_path), target)
        after = _states(d)
        for ms in TRAIN:
            for kind in kinds:
                for n, t in before[ms][kind].items():
                    assert torch.equal(after[ms][kind][n], t), (ms, kind, n)
            for k in COUNTERS:
                assert after[ms][k] == before[ms][k], (ms, k)
        d.step()
        st = d.gather_logical_state("actor.train", 1)
        assert all(torch.equal(w, st["master"][n].to(torch.bfloat16).float()) for n, w in st["params"].items())
    finally:
        d.close()


@pytest.mark.slow
def test_restart_refuses_a_layout_change_of_a_model_stage_that_was_not_saved(pool, tmp_path):
    d = RLDriver(SPEC, W, plan(), TASK, 4, CFG).start(pool)
    try:
        d.step()
        before = _states(d)
        durable.save(d, str(tmp_path), ["actor.train"])
        with pytest.raises(ValueError, match="critic.train"):
            durable.restart(d, str(tmp_path), plan(actor_train=(1, 1, 1, (0,)), critic_train=(2, 1, 1, (2, 3))))
        assert d.layouts["actor.train"].tp == 2  # nothing changed
        _assert_equal(_states(d), before, "refused")
        durable.restart(d, str(tmp_path), plan(actor_train=(1, 1, 1, (3,))))
        _assert_equal(_states(d), before, "actor only")
        d.step()
    finally:
        d.close()


def test_live_transition_doc_is_self_contained():
    import re
    from pathlib import Path

    doc = Path(__file__).resolve().parent.parent / "docs" / "live-transition.md"
    text = doc.read_text()
    for link in re.findall(r"\]\(([^)#]+)\)", text):
        assert not link.startswith("http"), link
        assert (doc.parent / link).exists(), link
    for path in re.findall(r"`((?:nereus|benchmarks|tests)/[\w/.-]+\.py)`", text):
        assert (doc.parent.parent / path).exists(), path
