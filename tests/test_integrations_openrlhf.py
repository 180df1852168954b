"""OpenRLHF import/export against OpenRLHF's own train_ppo_ray parser (read from the installed package
source; `pip install --no-deps openrlhf`: its GPU-only dependencies do not install on CPU), README-style
jobs checked by hand, expressible layouts evaluated, round trip."""

import shlex

import pytest

from nereus.cost.model import CostModel
from nereus.integrations.common import compare, layout_key
from nereus.integrations.openrlhf import argument_names, export_openrlhf, import_openrlhf, openrlhf_source
from nereus.planner.search import plan_job
from nereus.spec import ClusterSpec, JobSpec, WorkloadSpec, get_gpu, get_model

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


def test_readme_example_names_the_stale_options():
    with pytest.raises(ValueError, match="unrecognized arguments: --prompt_max_len 1024"):
        import_openrlhf(README, model="llama-3.1-8b")


def test_readme_example_job_and_unexpressible_settings():
    imp = import_openrlhf(README_011, model="llama-3.1-8b")
    w = imp.job.workload
    # hand-checked: gae -> PPO; 1024 prompts x 1 sample; train batch 128; 2048 - 1024 prompt tokens; RM given
    assert (w.algorithm, w.prompts_per_step, w.samples_per_prompt, w.mini_batch_size) == ("ppo", 1024, 1, 128)
    assert (w.prompt_len, w.response_len, w.reward_model, w.asynchronous) == (1024, 1024, True, False)
    assert imp.job.cluster.num_gpus == 8  # colocate_all: every group on the actor's 8 GPUs
    by = {c.model_stage: c for c in imp.layout}
    assert (by["actor.generate"].tp, by["actor.generate"].dp) == (2, 4)
    assert (by["actor.train"].dp, by["actor.train"].micro_batch, by["actor.train"].grad_accum) == (8, 1, 16)
    assert by["actor.train"].recompute == "full"
    assert [u.key for u in imp.unexpressible] == ["--ds.zero_stage", "--train.dynamic_batch_enable",
                                                  "--train.colocate_all"]
    rep = compare(imp)
    assert rep["user"]["expressible"] is False and "evaluation" not in rep["user"] and "speedup" not in rep


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


def test_export_keys_are_openrlhf_options_and_round_trip():
    names = argument_names()
    assert "--vllm.num_engines" in names and "--actor.num_gpus_per_node" in names
    job = JobSpec(get_model("llama-3.1-8b"), ClusterSpec(get_gpu("h100"), 4, 8),
                  WorkloadSpec(algorithm="grpo", prompts_per_step=128, samples_per_prompt=8, mini_batch_size=256,
                               prompt_len=1024, response_len=1024, reward_model=False))
    ex = export_openrlhf(job, plan_job(job))
    used = {t for t in ex["args"] if t.startswith("--")}
    assert used <= names, used - names
    back = import_openrlhf(shlex.join(ex["args"]), model="llama-3.1-8b")
    assert layout_key(back.layout) == layout_key(ex["layout"]) and back.expressible
    assert back.job.workload == job.workload
    assert ex["evaluation"].fits and ex["l_step"] >= plan_job(job).l_step * 0.999


def test_bad_estimator_names_key_and_valid():
    with pytest.raises(ValueError, match=r"--algo.advantage.estimator 'rloo'.*gae \(PPO\)"):
        import_openrlhf("--algo.advantage.estimator rloo --rollout.n_samples_per_prompt 4 "
                        "--rollout.max_new_tokens 512", model="tiny")
