"""``offload="cpu_adam"`` (ZeRO-Offload): memory, time, validation, framework modes and the search.

Hand values: Llama-3.1-8B has 8,030,261,248 parameters (its published count); ZeRO-2 over DP 8
gives each rank a 1/8 shard; DeepSpeed's CPU Adam touches 30 B per parameter; gradients down and
weights up are 2 B each over PCIe.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from nereus.cost.efficiency import EfficiencyTable
from nereus.cost.model import CostModel
from nereus.planner.search import NoFeasiblePlan, plan_job
from nereus.spec.framework import FrameworkSpec, get_framework
from nereus.spec.hardware import ClusterSpec, get_gpu
from nereus.spec.job import JobSpec
from nereus.spec.plan import Candidate
from nereus.spec.presets import get_model
from nereus.spec.workload import WorkloadSpec

P8B = 8_030_261_248


def _job(framework="deepspeed", nodes=1, gpn=8, model="llama-3.1-8b", **wl):
    w = dict(algorithm="ppo", prompt_len=1024, response_len=2048) | wl
    return JobSpec(get_model(model), ClusterSpec(get_gpu("h100"), nodes, gpn), WorkloadSpec(**w),
                   framework=get_framework(framework) if isinstance(framework, str) else framework)


def _cost(job):
    eff = EfficiencyTable()
    eff.set("offload@pcie", 0.8)
    eff.set("cpu_adam@host", 0.5)
    eff.set("memory_bound", 0.7)
    return CostModel(job, eff)


#: the deepspeed preset without DeepSpeed's own ZeRO-Offload buffers (tests/test_cost_zero_offload.py)
BARE = replace(get_framework("deepspeed"), zero_offload_buffers=False)
VH = 128256 * 4096  # Llama-3.1-8B's embedding / LM head, its largest parameter


def test_cpu_adam_memory_moves_the_optimizer_and_gradient_partitions_to_the_host():
    job = _job(BARE)
    cost = _cost(job)
    base = cost.estimate_candidate(Candidate("actor.train", 1, 1, 8, micro_batch=2, zero=2))
    off = cost.estimate_candidate(Candidate("actor.train", 1, 1, 8, micro_batch=2, zero=2, offload="cpu_adam"))
    # ZeRO-2 over 8: optimizer 12 B x P / 8 on the GPU without offload, none with it
    assert base.memory["optimizer"] == pytest.approx(12 * P8B / 8, rel=1e-9)
    assert off.memory["optimizer"] == 0
    # the bf16 weights stay resident (2 B x P), so resident drops by exactly the optimizer shard
    assert off.resident == pytest.approx(2 * P8B, rel=1e-9)
    assert base.resident - off.resident == pytest.approx(12 * P8B / 8, rel=1e-9)
    # gradients: ZeRO-2's fp32 partition 4 B x P / 8 on the GPU without offload; with it the partitions
    # are in host memory and the GPU keeps DeepSpeed's reduce bucket, 5e8 bf16 elements (P > 5e8)
    assert base.memory["gradients"] == pytest.approx(4 * P8B / 8, rel=1e-9)
    assert off.memory["gradients"] == pytest.approx(5e8 * 2, rel=1e-12)
    assert base.transient - off.transient == pytest.approx(4 * P8B / 8 - 1e9, rel=1e-9)
    # the preset adds DeepSpeed's own buffers: the resident bf16 buffer of the largest parameter, and
    # two reduce buckets (the preset overlaps the reduce: DeepSpeed's overlap_comm double buffer)
    ds = _cost(_job()).estimate_candidate(Candidate("actor.train", 1, 1, 8, micro_batch=2, zero=2, offload="cpu_adam"))
    assert ds.resident == pytest.approx(2 * P8B + 2 * VH, rel=1e-9)
    assert ds.memory["gradients"] == pytest.approx(2 * 5e8 * 2, rel=1e-12)


def test_cpu_adam_keeps_the_gradients_on_the_gpu_without_partitioned_gradients():
    """ZeRO-1 with ZeRO-Offload: the gradients are not partitioned (DeepSpeed reduces whole ones),
    so the GPU holds them all (4 B x P), as without offload."""
    cost = _cost(_job(BARE))
    off = cost.estimate_candidate(Candidate("actor.train", 1, 1, 8, micro_batch=2, zero=1, offload="cpu_adam"))
    assert off.memory["gradients"] == pytest.approx(4 * P8B, rel=1e-9)
    assert off.memory["optimizer"] == 0
    # with DeepSpeed's buffers (the preset): the two reduce buckets of its backward as well
    ds = _cost(_job()).estimate_candidate(Candidate("actor.train", 1, 1, 8, micro_batch=2, zero=1, offload="cpu_adam"))
    assert ds.memory["gradients"] == pytest.approx(4 * P8B + 2 * 5e8 * 2, rel=1e-9)


def test_cpu_adam_time_by_hand():
    job = _job()
    cost = _cost(job)
    w = job.workload
    updates = w.ppo_epochs * w.global_batch // w.mini_batch_size
    base = cost.estimate_candidate(Candidate("actor.train", 1, 1, 8, micro_batch=2, zero=2))
    off = cost.estimate_candidate(Candidate("actor.train", 1, 1, 8, micro_batch=2, zero=2, offload="cpu_adam"))
    shard = P8B / 8
    adam = updates * shard * 30 / (76.8e9 * 0.5)  # DGX H100: 614.4 GB/s of DRAM / 8 GPUs
    pcie = updates * 2 * shard * 2 / (64e9 * 0.8)  # PCIe Gen5 x16, 64 GB/s per direction
    gpu_adam = updates * shard * 36 / (3.35e12 * 0.7)  # what the GPU step cost (36 B per param over HBM)
    assert off.breakdown["cpu_adam@host"] == pytest.approx(adam, rel=1e-9)
    assert off.breakdown["offload@pcie"] == pytest.approx(pcie, rel=1e-9)
    assert "cpu_adam@host" not in base.breakdown and "offload@pcie" not in base.breakdown
    assert off.time - base.time == pytest.approx(adam + pcie - gpu_adam, rel=1e-9)


def test_cpu_adam_without_zero_updates_the_whole_replica():
    job = _job()
    cost = _cost(job)
    w = job.workload
    updates = w.ppo_epochs * w.global_batch // w.mini_batch_size
    off = cost.estimate_candidate(Candidate("actor.train", 1, 1, 8, micro_batch=2, zero=0, offload="cpu_adam"))
    assert off.breakdown["cpu_adam@host"] == pytest.approx(updates * P8B * 30 / (76.8e9 * 0.5), rel=1e-9)


def test_cpu_adam_is_for_training_only():
    with pytest.raises(ValueError, match=r"actor.infer: offload 'cpu_adam'.*training model-stages only"):
        Candidate("actor.infer", 1, 1, 1, micro_batch=1, offload="cpu_adam")
    fw = get_framework("deepspeed")
    assert "cpu_adam" in fw.offload_modes("actor.train")
    assert "cpu_adam" not in fw.offload_modes("actor.generate")
    assert "cpu_adam" not in fw.offload_modes("reference.infer")
    with pytest.raises(ValueError, match=r"'offload'.*'cpu_adam'.*got \['none', 'nvme'\]"):
        FrameworkSpec(offload=("none", "nvme"))


def test_search_uses_cpu_adam_when_only_it_fits():
    """Llama-3.1-8B PPO on 8 H100s, training with ZeRO-1 only and no TP/PP: every training
    replica holds the bf16 weights (16 GiB) and full fp32 gradients (32 GiB) besides its optimizer
    shard, so no split of the 8 GPUs fits; with the optimizer shard (12 B x 8.03e9 / dp) on the
    CPU a plan fits, and it uses cpu_adam for a training model-stage."""
    base = FrameworkSpec(name="z1", zero_stages=(1,), offload=("none",), colocate="auto",
                         model_parallel_train=False)
    job = _job(base)
    with pytest.raises(NoFeasiblePlan):
        plan_job(job)
    plan = plan_job(job.with_framework(FrameworkSpec(name="z1+cpu", zero_stages=(1,), offload=("none", "cpu_adam"),
                                                     colocate="auto", model_parallel_train=False)))
    used = {c.model_stage: c.offload for c in plan.candidates}
    assert "cpu_adam" in {used["actor.train"], used["critic.train"]}
    assert all(c.offload == "none" for c in plan.candidates if not c.model_stage.endswith(".train"))
