"""OpenRLHF import/export against OpenRLHF's own train_ppo_ray parser (read from the installed package
source; `pip install --no-deps openrlhf`: its GPU-only dependencies do not install on CPU), README-style
jobs checked by hand (colocation, ZeRO stages, offload flags), step times recomputed from the cost
model's per-candidate estimates, settings still refused named, round trips."""

import shlex
from dataclasses import replace

import pytest

from nereus.cost.memory import WORKSPACE_BYTES
from nereus.cost.model import CostModel
from nereus.integrations.common import compare, layout_key
from nereus.integrations.openrlhf import argument_names, import_openrlhf, openrlhf_source
from nereus.integrations.openrlhf_export import export_openrlhf
from nereus.planner.search import plan_job
from nereus.spec.hardware import ClusterSpec, get_gpu
from nereus.spec.job import JobSpec
from nereus.spec.presets import get_model
from nereus.spec.workload import WorkloadSpec

pytestmark = pytest.mark.skipif(openrlhf_source() is None, reason="OpenRLHF not installed (pip install --no-deps openrlhf)")

# OpenRLHF 0.11.2 README "RL Training: PPO/REINFORCE++ with Ray and vLLM" (model paths and logging kept)
README = """ray job submit --address="http://127.0.0.1:8265" --runtime-env-json='{"working_dir": "/openrlhf"}' \
 -- python3 -m openrlhf.cli.train_ppo_ray --ref.num_nodes 1 --ref.num_gpus_per_node 8 --reward.num_nodes 1 \
 --reward.num_gpus_per_node 8 --critic.num_nodes 1 --critic.num_gpus_per_node 8 --actor.num_nodes 1 \
 --actor.num_gpus_per_node 8 --vllm.num_engines 4 --vllm.tensor_parallel_size 2 --train.colocate_all \
 --vllm.gpu_memory_utilization 0.5 --actor.model_name_or_path OpenRLHF/Llama-3-8b-sft-mixture \
 --reward.model_name_or_path OpenRLHF/Llama-3-8b-rm-700k --ckpt.save_hf --train.batch_size 128 \
 --rollout.batch_size 1024 --train.dynamic_batch_enable --rollout.n_samples_per_prompt 1 --train.max_epochs 1 \
 --prompt_max_len 1024 --data.max_samples 100000 --generate_max_len 1024 --ds.zero_stage 3 --ds.param_dtype bf16 \
 --actor.adam.lr 5e-7 --critic.adam.lr 9e-6 --algo.kl.init_coef 0.01 --data.prompt_dataset OpenRLHF/prompt-collection-v0.1 \
 --data.input_key context_messages --data.apply_chat_template --reward.normalize_enable \
 --actor.gradient_checkpointing_enable --ds.packing_samples --vllm.sync_backend nccl --vllm.enforce_eager \
 --vllm.enable_sleep --ds.enable_sleep"""
# the README's --prompt_max_len / --generate_max_len are not options of 0.11.2's parser; their 0.11 names:
README_011 = README.replace("--prompt_max_len 1024", "--data.max_len 2048").replace("--generate_max_len 1024",
                                                                                  "--rollout.max_new_tokens 1024")


def test_readme_example_with_stale_options_imports_as_the_011_names():
    # the README's --prompt_max_len / --generate_max_len (flat pre-0.11 names) are translated
    # (nereus.integrations.openrlhf_legacy): the same job and layout as with the 0.11 names
    stale, new = import_openrlhf(README, model="llama-3.1-8b"), import_openrlhf(README_011, model="llama-3.1-8b")
    assert stale.job == new.job and stale.layout == new.layout
    assert any("flat (pre-0.11) option names translated" in n for n in stale.notes)


def test_readme_example_job_and_unexpressible_settings():
    imp = import_openrlhf(README_011, model="llama-3.1-8b")
    w = imp.job.workload
    # hand-checked: gae -> PPO; 1024 prompts x 1 sample; train batch 128; 2048 - 1024 prompt tokens; RM given
    assert (w.algorithm, w.prompts_per_step, w.samples_per_prompt, w.mini_batch_size) == ("ppo", 1024, 1, 128)
    assert (w.prompt_len, w.response_len, w.reward_model, w.asynchronous) == (1024, 1024, True, False)
    assert imp.job.cluster.num_gpus == 8  # colocate_all: every group on the actor's 8 GPUs
    by = {c.model_stage: c for c in imp.layout}
    assert (by["actor.generate"].tp, by["actor.generate"].dp) == (2, 4)
    # --train.dynamic_batch_enable: a budget of --train.max_tokens_per_gpu 16192 (default) tokens holds 16192 // 2048 = 7
    # full-length sequences; the largest divisor of the 128 / 8 = 16 sequences per replica <= 7 is 4
    assert (by["actor.train"].dp, by["actor.train"].micro_batch, by["actor.train"].grad_accum) == (8, 4, 4)
    assert by["actor.train"].recompute == "full"
    # --ds.zero_stage 3, --ds.enable_sleep (DeepSpeed states offloaded between phases), --vllm.enable_sleep
    assert [(by[k].zero, by[k].offload) for k in ("actor.train", "critic.train")] == [(3, "host")] * 2
    assert by["actor.generate"].offload == "host" and all(c.gpus == tuple(range(8)) for c in imp.layout)
    # vLLM pre-allocates its 0.5; nothing stays outside the cost model
    assert imp.job.workload.rollout_memory_fraction == 0.5
    assert imp.unexpressible == []
    rep = compare(imp)
    assert rep["user"]["expressible"] is True and "evaluation" in rep["user"]


COLOCATED = ("--actor.num_nodes 1 --actor.num_gpus_per_node 8 --critic.num_nodes 1 --critic.num_gpus_per_node 8 "
             "--ref.num_nodes 1 --ref.num_gpus_per_node 8 --reward.num_nodes 1 --reward.num_gpus_per_node 8 "
             "--vllm.num_engines 4 --vllm.tensor_parallel_size 2 --vllm.gpu_memory_utilization 0.4 "
             "--train.colocate_all --ds.zero_stage 3 --ds.adam_offload --vllm.enable_sleep --ref.offload "
             "--reward.offload --train.batch_size 128 --train.micro_batch_size 4 --rollout.batch_size 128 "
             "--rollout.n_samples_per_prompt 4 --rollout.micro_batch_size 8 --data.max_len 3072 "
             "--rollout.max_new_tokens 2048 --reward.model_name_or_path rm --actor.gradient_checkpointing_enable")


def test_colocate_all_zero3_adam_offload_by_hand():
    imp = import_openrlhf(COLOCATED, model="llama-3.1-8b")
    assert imp.expressible, imp.unexpressible
    fw = imp.job.framework
    assert (fw.name, fw.zero_stages, fw.grad_reduce_bytes, fw.overlap_grad_reduce) == \
        ("openrlhf-deepspeed", (0, 1, 2, 3), 2, False)
    by = {c.model_stage: c for c in imp.layout}
    # every model and the 4 x TP2 vLLM engines on the actor's GPUs 0-7
    assert imp.job.cluster.num_gpus == 8 and all(c.gpus == tuple(range(8)) for c in imp.layout)
    # ZeRO-3 and Adam offload (ZeRO-Offload) on both trained models: DP 8, 128 / (8 x 4) = 4 accumulation steps
    for k in ("actor.train", "critic.train"):
        assert (by[k].dp, by[k].micro_batch, by[k].grad_accum, by[k].zero, by[k].offload) == (8, 4, 4, 3, "cpu_adam")
    assert [by[k].offload for k in ("reference.infer", "reward.infer", "actor.generate", "actor.infer")] == \
        ["host", "host", "host", "none"]
    # ZeRO-3: the evaluation engines and the training engines' forward passes run sharded
    assert [by[k].zero for k in ("actor.infer", "critic.infer", "reference.infer", "reward.infer", "actor.generate")] \
        == [3, 3, 3, 3, 0]
    cost = CostModel(imp.job)
    est = {c.model_stage: cost.estimate_candidate(c, False) for c in imp.layout}
    ev = compare(imp)["user"]["evaluation"]
    # all on the same GPUs, so every stage is the sum of its model-stages' times
    assert ev["stage_times"]["infer"] == pytest.approx(sum(est[k].time for k in (
        "actor.infer", "critic.infer", "reference.infer", "reward.infer")), rel=1e-9)
    assert ev["stage_times"]["train"] == pytest.approx(est["actor.train"].time + est["critic.train"].time, rel=1e-9)
    assert ev["l_step"] == pytest.approx(sum(e.time for e in est.values()), rel=1e-9)
    # per-GPU peak: workspace + resident of every model-stage (offloaded ones: none) + the largest transient
    # ZeRO-Offload: no optimizer bytes on the GPU, the weights stay; offloaded inference state: none resident
    assert est["actor.train"].memory["optimizer"] == 0 and est["actor.train"].resident > 0
    assert est["reference.infer"].resident == 0
    # actor.infer and critic.infer run on the actor's and critic's DeepSpeed engines (shared_engine): no weights
    # of their own
    owned = ("actor.infer", "critic.infer")
    peak = WORKSPACE_BYTES + sum(e.resident for k, e in est.items() if k not in owned) + \
        max(e.transient for e in est.values())
    assert ev["model_stages"]["actor.generate"]["peak_gib"] * 2**30 == pytest.approx(peak, rel=1e-9)
    assert any("--ds.adam_offload" in n for n in imp.notes) and any("zero_stage 3" in n for n in imp.notes)


def test_partial_colocation_shares_pairs_of_groups():
    args = COLOCATED.replace("--train.colocate_all", "--train.colocate_actor_ref --train.colocate_critic_reward")
    imp = import_openrlhf(args, model="llama-3.1-8b")
    by = {c.model_stage: c for c in imp.layout}
    # actor and reference on 0-7, critic and reward on 8-15, vLLM engines on 16-23 (sleep needs colocate_all)
    assert by["reference.infer"].gpus == by["actor.train"].gpus == tuple(range(8))
    assert by["reward.infer"].gpus == by["critic.train"].gpus == tuple(range(8, 16))
    assert by["actor.generate"].gpus == tuple(range(16, 24)) and by["actor.generate"].offload == "none"
    cost = CostModel(imp.job)
    t = {c.model_stage: cost.estimate_candidate(c, True).time for c in imp.layout}
    ev = compare(imp)["user"]["evaluation"]
    assert ev["stage_times"]["infer"] == pytest.approx(max(t["actor.infer"] + t["reference.infer"],
                                                           t["critic.infer"] + t["reward.infer"]), rel=1e-9)
    assert ev["l_step"] == pytest.approx(t["actor.generate"] + ev["stage_times"]["infer"]
                                         + max(t["actor.train"], t["critic.train"]), rel=1e-9)


@pytest.mark.parametrize("extra,key", [("--ds.zpg 2", "--ds.zpg"), ("--ds.lora.rank 16 --ds.lora.target_modules q_proj",
                                                                     "--ds.lora.target_modules")])
def test_settings_still_refused_are_named(extra, key):
    imp = import_openrlhf(COLOCATED + " " + extra, model="llama-3.1-8b")
    assert [u.key for u in imp.unexpressible] == [key]
    assert "evaluation" not in compare(imp)["user"]


def test_colocation_group_sizes_are_checked():
    bad = COLOCATED.replace("--vllm.num_engines 4", "--vllm.num_engines 2")
    with pytest.raises(ValueError, match="--vllm.num_engines 2 x --vllm.tensor_parallel_size 2 must equal"):
        import_openrlhf(bad, model="llama-3.1-8b")
    bad = COLOCATED.replace("--ref.num_gpus_per_node 8", "--ref.num_gpus_per_node 4")
    with pytest.raises(ValueError, match="--ref.num_nodes x --ref.num_gpus_per_node = 4 GPUs must equal"):
        import_openrlhf(bad, model="llama-3.1-8b")


def test_expressible_layout_is_evaluated_by_hand():
    args = ("--actor.num_nodes 2 --actor.num_gpus_per_node 8 --critic.num_nodes 1 --critic.num_gpus_per_node 8 "
            "--ref.num_nodes 1 --ref.num_gpus_per_node 4 --reward.num_nodes 1 --reward.num_gpus_per_node 4 "
            "--vllm.num_engines 4 --vllm.tensor_parallel_size 2 --vllm.gpu_memory_utilization 0.6 "
            "--ds.zero_stage 0 --ds.tensor_parallel_size 2 --train.batch_size 256 --train.micro_batch_size 2 "
            "--rollout.batch_size 128 --rollout.n_samples_per_prompt 4 --rollout.micro_batch_size 4 "
            "--data.max_len 3072 --rollout.max_new_tokens 2048 --reward.model_name_or_path rm "
            "--actor.gradient_checkpointing_enable")
    imp = import_openrlhf(args, model="llama-3.1-8b")
    assert imp.expressible
    # groups on consecutive GPUs: actor 0-15, critic 16-23, ref 24-27, reward 28-31, vLLM 32-39; 8 per node
    by = {c.model_stage: c for c in imp.layout}
    assert not any(c.zero for c in imp.layout)  # --ds.zero_stage 0: evaluation engines at stage 0 too
    assert by["actor.train"].gpus == tuple(range(16)) and by["critic.train"].gpus == tuple(range(16, 24))
    assert by["reference.infer"].gpus == tuple(range(24, 28)) and by["reward.infer"].gpus == tuple(range(28, 32))
    assert by["actor.generate"].gpus == tuple(range(32, 40)) and imp.job.cluster.num_nodes == 5
    # DP = 16 GPUs / TP 2 = 8; grad accumulation 256 / (8 x 2) = 16
    assert (by["actor.train"].dp, by["actor.train"].grad_accum) == (8, 16)
    rep = compare(imp)
    cost = CostModel(imp.job)
    t = {c.model_stage: cost.estimate_candidate(c, True).time for c in imp.layout}
    want = (t["actor.generate"] + max(t[m] for m in ("actor.infer", "critic.infer", "reference.infer", "reward.infer"))
            + max(t["actor.train"], t["critic.train"]))
    ev = rep["user"]["evaluation"]
    assert ev["l_step"] == pytest.approx(want, rel=1e-9)
    if ev["fits"]:
        assert rep["speedup"] == pytest.approx(want / rep["nereus"]["l_step"])


@pytest.mark.parametrize("algo,nodes,reward", [("grpo", 4, False), ("ppo", 2, True), ("ppo", 4, False)])
def test_export_keys_are_openrlhf_options_and_round_trip(algo, nodes, reward):
    names = argument_names()
    assert "--vllm.num_engines" in names and "--actor.num_gpus_per_node" in names
    job = JobSpec(get_model("llama-3.1-8b"), ClusterSpec(get_gpu("h100"), nodes, 8),
                  WorkloadSpec(algorithm=algo, prompts_per_step=128, samples_per_prompt=8, mini_batch_size=256,
                               prompt_len=1024, response_len=1024, reward_model=reward))
    ex = export_openrlhf(job, plan_job(job))
    used = {t for t in ex["args"] if t.startswith("--")}
    assert used <= names, used - names
    back = import_openrlhf(shlex.join(ex["args"]), model="llama-3.1-8b")
    assert layout_key(back.layout) == layout_key(ex["layout"]) and back.expressible
    frac = float(ex["args"][ex["args"].index("--vllm.gpu_memory_utilization") + 1])  # the fraction the export sized
    assert back.job.workload == replace(job.workload, rollout_memory_fraction=frac)
    assert back.job.framework.to_dict() == ex["framework_spec"]
    assert ex["evaluation"].fits
    assert compare(back)["user"]["evaluation"]["l_step"] == pytest.approx(ex["l_step"], rel=1e-9)
    # the layout uses what OpenRLHF says it uses: colocation, ZeRO stage, offload flags
    by = {c.model_stage: c for c in ex["layout"]}
    assert ("--train.colocate_all" in used) == bool(set(by["actor.generate"].gpus) & set(by["actor.train"].gpus))
    assert ex["args"][ex["args"].index("--ds.zero_stage") + 1] == str(by["actor.train"].zero)
    assert ("--ds.adam_offload" in used) == (by["actor.train"].offload == "cpu_adam")
    assert ("--ds.enable_sleep" in used) == (by["actor.train"].offload == "host")


def test_bad_estimator_names_key_and_valid():
    with pytest.raises(ValueError, match=r"--algo.advantage.estimator 'rloo'.*gae \(PPO\)"):
        import_openrlhf("--algo.advantage.estimator rloo --rollout.n_samples_per_prompt 4 "
                        "--rollout.max_new_tokens 512", model="tiny")


def test_without_the_package_the_keys_read_give_the_same_layout(monkeypatch):
    import nereus.integrations.openrlhf as o

    with_parser = import_openrlhf(COLOCATED + " --algo.kl.init_coef 0", model="llama-3.1-8b")
    monkeypatch.setattr(o, "openrlhf_parser", lambda source=None: None)
    without = import_openrlhf(COLOCATED + " --algo.kl.init_coef 0", model="llama-3.1-8b")
    assert without.layout == with_parser.layout and without.job == with_parser.job
    assert without.job.framework == with_parser.job.framework
    assert any("init_coef 0" in n for n in without.notes) and any("not installed" in n for n in without.notes)


def test_ring_attention_lora_and_empty_input():
    # ring attention 2 on the actor's 8 GPUs: DP = 8 / 2 = 4; 128 / 4 = 32 sequences per replica, micro-batch 4
    imp = import_openrlhf(COLOCATED + " --ds.ring_attn_size 2 --ds.lora.rank 16", model="llama-3.1-8b")
    assert imp.expressible, imp.unexpressible
    a = {c.model_stage: c for c in imp.layout}["actor.train"]
    assert (a.dp, a.cp, a.micro_batch, a.grad_accum, a.num_gpus) == (4, 2, 4, 8, 8)
    assert imp.job.workload.lora_rank == 16
    for empty in ("", "   ", "python3 -m openrlhf.cli.train_ppo_ray"):
        with pytest.raises(ValueError, match="empty"):
            import_openrlhf(empty, model="llama-3.1-8b")
    with pytest.raises(ValueError, match="unknown GPU 'h900'"):  # the GPU is checked before anything else
        import_openrlhf(COLOCATED.replace("--vllm.num_engines 4", ""), model="llama-3.1-8b", gpu="h900")
    no_vllm = import_openrlhf(COLOCATED.replace("--vllm.num_engines 4", "").replace("--train.colocate_all", ""),
                              model="llama-3.1-8b")
    assert [u.key for u in no_vllm.unexpressible] == ["--vllm.num_engines"]
