"""Lines written for older framework releases import as written: OpenRLHF's flat (pre-0.11) option
names translated to 0.11's, their release's defaults filled in, PPO-ptx refused by name; a verl
``+key=value`` for a key a later verl has is set (Hydra's ``++``)."""

import pytest

from nereus.integrations.openrlhf import argument_names, import_openrlhf, openrlhf_source, parse_args
from nereus.integrations.openrlhf_legacy import LEGACY_DEFAULTS, RENAMED, is_legacy, translate_legacy
from nereus.integrations.verl_config import load_verl_config, verl_config_dir


@pytest.mark.skipif(openrlhf_source() is None, reason="OpenRLHF not installed")
def test_every_translation_is_an_option_of_openrlhf_011():
    names = argument_names()
    assert sorted(v for v in RENAMED.values() if v not in names) == []


def test_translation_by_hand():
    toks = ["ray", "job", "submit", "--address=http://h:8265", "--", "python3", "examples/train_ppo_ray.py",
            "--pretrain", "m", "--prompt_max_len", "1024", "--generate_max_len", "512", "--bf16",
            "--ref_reward_offload", "--flash_attn", "--zero_stage", "3", "--vllm_num_engines", "2"]
    assert is_legacy(toks) and not is_legacy(["--actor.model_name_or_path", "m", "--ds.zero_stage", "3"])
    out, notes, refused = translate_legacy(toks)
    # the entry point and what comes before it are cut; prompt 1024 + response 512 = --data.max_len 1536;
    # v0.8.0's defaults for the micro-batches the line leaves out (4 training, 8 rollout)
    assert out == ["--actor.model_name_or_path", "m", "--ds.param_dtype", "bf16", "--ref.offload", "--reward.offload",
                   "--ds.zero_stage", "3", "--vllm.num_engines", "2", "--train.micro_batch_size", "4",
                   "--rollout.micro_batch_size", "8", "--data.max_len", "1536", "--rollout.max_new_tokens", "512"]
    assert refused == [] and any("--flash_attn" in n for n in notes)
    assert LEGACY_DEFAULTS["--micro_rollout_batch_size"] == "8"
    # a dotted option the line gives wins over a flat-name default
    out, _, _ = translate_legacy(["--prompt_max_len", "8", "--train.micro_batch_size", "2"])
    assert "--train.micro_batch_size" in out and out[out.index("--train.micro_batch_size") + 1] == "2"
    assert out.count("--train.micro_batch_size") == 1
    with pytest.raises(ValueError, match="--generate_max_len 'x'"):
        translate_legacy(["--generate_max_len", "x"])


@pytest.mark.skipif(openrlhf_source() is None, reason="OpenRLHF not installed")
def test_flat_line_imports_as_its_011_translation_and_ptx_is_named():
    flat = ("--ref_num_nodes 1 --ref_num_gpus_per_node 2 --actor_num_nodes 1 --actor_num_gpus_per_node 2 "
            "--vllm_num_engines 2 --vllm_tensor_parallel_size 1 --pretrain qwen --remote_rm_url http://rm "
            "--micro_train_batch_size 2 --train_batch_size 64 --micro_rollout_batch_size 4 --rollout_batch_size 64 "
            "--prompt_max_len 512 --generate_max_len 1024 --zero_stage 3 --bf16 --advantage_estimator group_norm "
            "--n_samples_per_prompt 4 --gradient_checkpointing --adam_offload --flash_attn")
    dotted = ("--ref.num_nodes 1 --ref.num_gpus_per_node 2 --actor.num_nodes 1 --actor.num_gpus_per_node 2 "
              "--vllm.num_engines 2 --vllm.tensor_parallel_size 1 --actor.model_name_or_path qwen "
              "--reward.remote_url http://rm --train.micro_batch_size 2 --train.batch_size 64 "
              "--rollout.micro_batch_size 4 --rollout.batch_size 64 --data.max_len 1536 --rollout.max_new_tokens 1024 "
              "--ds.zero_stage 3 --ds.param_dtype bf16 --algo.advantage.estimator group_norm "
              "--rollout.n_samples_per_prompt 4 --actor.gradient_checkpointing_enable --ds.adam_offload")
    a, b = import_openrlhf(flat, model="qwen2.5-0.5b"), import_openrlhf(dotted, model="qwen2.5-0.5b")
    assert a.job == b.job and a.layout == b.layout and a.expressible
    # 0.5-0.6's --use_kl_estimator_k3 is 0.11's --algo.kl.estimator k3 (default k1), parsed by OpenRLHF's parser
    assert parse_args(flat + " --use_kl_estimator_k3")[0]["algo.kl.estimator"] == "k3"
    assert parse_args(flat)[0]["algo.kl.estimator"] == "k1"
    ptx = import_openrlhf(flat + " --pretrain_data d --ptx_coef 0.05", model="qwen2.5-0.5b")
    assert {u.key for u in ptx.unexpressible} >= {"--pretrain_data", "--ptx_coef"}


@pytest.mark.skipif(verl_config_dir() is None, reason="verl not installed")
def test_verl_append_of_a_key_a_later_verl_has_sets_it():
    # TinyZero's scripts (verl 0.1) add trainer.val_before_train, which verl's own config has since
    base = ["data.train_batch_size=8", "actor_rollout_ref.model.path=x"]
    cfg = load_verl_config("ppo_trainer", base + ["+trainer.val_before_train=False"])
    assert cfg["trainer"]["val_before_train"] is False
    cfg = load_verl_config("ppo_trainer", base + ["+trainer.nereus_new_key=3"])  # a new key is still added
    assert cfg["trainer"]["nereus_new_key"] == 3
    with pytest.raises(ValueError, match="no_such_key"):  # an unknown key without + is still refused
        load_verl_config("ppo_trainer", base + ["trainer.no_such_key=1"])
