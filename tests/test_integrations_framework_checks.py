"""Exports compose with the frameworks' own configuration checks (verl's ``validate_config``,
OpenRLHF's parser and its ``__main__`` checks: nereus/integrations/framework_checks.py) and round-trip:
importing the export gives the exported layout. The checks can fail: a configuration each framework
refuses is refused."""

import json
import shlex

import pytest

from nereus.cli import main
from nereus.integrations.framework_checks import openrlhf_check, verl_check
from nereus.integrations.openrlhf import import_openrlhf, openrlhf_source
from nereus.integrations.verl import import_verl
from nereus.integrations.verl_config import load_verl_config, verl_config_dir

pytestmark = pytest.mark.skipif(verl_config_dir() is None or openrlhf_source() is None,
                                reason="needs verl and OpenRLHF installed")

KEYS = ("tp", "pp", "dp", "micro_batch", "grad_accum", "recompute", "concurrency", "zero", "offload", "vpp")
FSDP = ["ppo_trainer", "algorithm.adv_estimator=grpo", "data.train_batch_size=256", "data.max_prompt_length=512",
        "data.max_response_length=1024", "actor_rollout_ref.actor.ppo_mini_batch_size=64",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16", "trainer.n_gpus_per_node=8", "trainer.nnodes=1",
        "data.train_files=/data/train.parquet"]
# GRPO: verl's validate_config instantiates a critic's HF model config from its path (a real checkpoint)
MEGATRON = ["ppo_megatron_trainer", "algorithm.adv_estimator=grpo", "data.train_batch_size=512",
            "data.max_prompt_length=1024", "data.max_response_length=2048", "actor_rollout_ref.actor.ppo_mini_batch_size=128",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
            "trainer.n_gpus_per_node=8", "trainer.nnodes=2"]
OPENRLHF = ("--actor.num_nodes 1 --actor.num_gpus_per_node 8 --ref.num_nodes 1 --ref.num_gpus_per_node 8 "
            "--vllm.num_engines 8 --vllm.tensor_parallel_size 1 --train.colocate_all --vllm.enable_sleep "
            "--ds.enable_sleep --vllm.gpu_memory_utilization 0.6 --actor.model_name_or_path {model} "
            "--reward.remote_url http://rm:5000/get_reward --algo.advantage.estimator group_norm "
            "--rollout.n_samples_per_prompt 8 --rollout.batch_size 128 --train.batch_size 128 "
            "--train.micro_batch_size 4 --rollout.micro_batch_size 8 --data.max_len 3072 --rollout.max_new_tokens 2048 "
            "--ds.zero_stage 3 --data.prompt_dataset my/prompts --actor.gradient_checkpointing_enable")


def _export(argv, capsys):
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("line, model", [(FSDP, "qwen2.5-0.5b"), (MEGATRON, "llama-3.1-8b")])
def test_verl_export_passes_validate_config_and_round_trips(line, model, capsys):
    verl_check(line[0], line[1:])  # the user's own configuration is one verl accepts
    ex = _export(["--from-verl", *line, "--model", model, "--export", "verl"], capsys)
    assert ex["backend"] == ("megatron" if line is MEGATRON else "fsdp")
    verl_check(ex["config_name"], ex["overrides"])  # verl's own checks accept the export
    back = import_verl(load_verl_config(ex["config_name"], ex["overrides"]), model=model)
    assert back.expressible
    got = {c.model_stage: tuple(getattr(c, k) for k in KEYS) for c in back.layout}
    assert got == {n: tuple(m[k] for k in KEYS) for n, m in ex["evaluation"]["model_stages"].items()}


def test_verl_check_refuses_what_verl_refuses():
    with pytest.raises(ValueError, match="validate_config.*train_batch_size"):
        verl_check(FSDP[0], [*FSDP[1:], "data.train_batch_size=16"])  # 16 < the mini-batch of 64


def test_openrlhf_export_passes_its_checks_and_round_trips(capsys):
    line = OPENRLHF.format(model="/models/q05")
    openrlhf_check(shlex.split(line))
    ex = _export(["--from-openrlhf", line, "--model", "qwen2.5-0.5b", "--export", "openrlhf"], capsys)
    openrlhf_check(ex["args"])  # OpenRLHF's parser and __main__ checks accept the export
    back = import_openrlhf(shlex.join(ex["args"]), model="qwen2.5-0.5b")
    assert back.expressible
    got = {c.model_stage: tuple(getattr(c, k) for k in KEYS) for c in back.layout}
    want = {n: tuple(m[k] for k in KEYS) for n, m in ex["evaluation"]["model_stages"].items()}
    assert got == want


def test_openrlhf_check_refuses_what_openrlhf_refuses():
    bad = shlex.split(OPENRLHF.format(model="/m").replace("--rollout.n_samples_per_prompt 8",
                                                           "--rollout.n_samples_per_prompt 1"))
    with pytest.raises(ValueError, match="group_norm requires n_samples_per_prompt > 1"):
        openrlhf_check(bad)
