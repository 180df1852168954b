"""Every key of verl's full trainer configs and every option of OpenRLHF's parser is read by the
importer or classified (no effect / noted / refused), and a memory- or time-changing setting outside
the plan space is named when set (issue 28, item 2)."""

import json

import pytest
from omegaconf import OmegaConf

from nereus.integrations import openrlhf_keys, verl_keys
from nereus.integrations.openrlhf import _DEFAULTS, argument_names, import_openrlhf, openrlhf_source
from nereus.integrations.verl import import_verl
from nereus.integrations.verl_config import load_verl_config, verl_config_dir

pytestmark = pytest.mark.skipif(verl_config_dir() is None or openrlhf_source() is None,
                                reason="needs verl and OpenRLHF installed")

Q05 = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
       "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768, "tie_word_embeddings": True,
       "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "model_type": "qwen2"}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("m") / "q"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(Q05))
    return ["data.train_batch_size=256", f"actor_rollout_ref.model.path={d}", "actor_rollout_ref.actor.ppo_mini_batch_size=64",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8", "critic.ppo_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.rollout.n=4", "trainer.n_gpus_per_node=8",
            "trainer.nnodes=1", "reward.reward_model.enable=True"]


@pytest.mark.parametrize("name", ["ppo_trainer", "ppo_megatron_trainer"])
def test_every_verl_key_is_read_or_classified(name, base):
    full = OmegaConf.to_container(OmegaConf.load(verl_config_dir() / f"_generated_{name}.yaml"), resolve=False)
    imp = import_verl(load_verl_config(name, base))
    keys = list(verl_keys.leaves(full))
    assert len(keys) > 800  # the whole config, not a section
    missing = [k for k in keys if k not in imp.read and verl_keys.classify(k) is None]
    assert missing == []
    # nothing at verl's defaults is reported
    assert imp.unexpressible == [] and not any("not a key Nereus reads" in n for n in imp.notes)


@pytest.mark.parametrize("override,kind", [
    ("actor_rollout_ref.rollout.quantization=fp8", "refused"),
    ("actor_rollout_ref.actor.optim.optimizer=Muon", "refused"),
    ("algorithm.filter_groups.enable=True", "refused"),
    ("actor_rollout_ref.rollout.multi_turn.enable=True", "refused"),
    ("actor_rollout_ref.rollout.enforce_eager=True", "noted"),
    ("actor_rollout_ref.model.use_liger=True", "noted"),
    ("critic.ppo_epochs=2", "refused"),
])
def test_a_verl_setting_outside_the_plan_space_is_named(base, override, kind):
    imp = import_verl(load_verl_config("ppo_trainer", base + [override]))
    key = override.split("=")[0]
    if kind == "refused":
        assert key in [u.key for u in imp.unexpressible]
    else:
        assert imp.expressible and any(n.startswith(key + "=") for n in imp.notes)


def test_every_openrlhf_option_is_read_or_classified():
    names = sorted(n[2:] for n in argument_names())
    assert len(names) > 150
    imp = import_openrlhf("--actor.num_nodes 1 --actor.num_gpus_per_node 8 --ref.num_nodes 1 --ref.num_gpus_per_node 8 "
                          "--vllm.num_engines 8 --rollout.max_new_tokens 1024 --data.max_len 2048 --train.colocate_all "
                          "--reward.remote_url http://rm", model="llama-3.1-8b")
    assert [n for n in names if n not in imp.read and n not in _DEFAULTS and openrlhf_keys.classify(n) is None] == []
    assert imp.expressible and not any("not an option Nereus reads" in n for n in imp.notes)
    refused = import_openrlhf("--actor.num_nodes 1 --actor.num_gpus_per_node 8 --ref.num_nodes 1 --ref.num_gpus_per_node 8 "
                              "--vllm.num_engines 8 --rollout.max_new_tokens 1024 --data.max_len 2048 --train.colocate_all "
                              "--reward.remote_url http://rm --ds.load_in_4bit --vllm.enforce_eager", model="llama-3.1-8b")
    assert [u.key for u in refused.unexpressible] == ["--ds.load_in_4bit"]
    assert any(n.startswith("--vllm.enforce_eager") for n in refused.notes)
