"""Exports to the other framework keep the user's settings that have an equivalent there (model
paths, data files, KL, reward model; nereus.integrations.export_carry), checked against OpenRLHF's own
train_ppo_ray parser and verl's own trainer config; the rest is named in a note, never a placeholder."""

import json
import shlex

import pytest

from nereus.cli import main
from nereus.integrations.export_carry import export_model_path, openrlhf_to_verl, verl_to_openrlhf
from nereus.integrations.openrlhf import openrlhf_parser, openrlhf_source
from nereus.integrations.verl_config import load_verl_config, verl_config_dir

pytestmark = pytest.mark.skipif(openrlhf_source() is None or verl_config_dir() is None,
                                reason="needs OpenRLHF and verl installed")

# Hugging Face config.json fields of Qwen2.5-0.5B-Instruct
QWEN05 = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
          "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
          "tie_word_embeddings": True, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "model_type": "qwen2"}

VERL = """python3 -m verl.trainer.main_ppo --config-name=ppo_trainer \\
    data.train_files=/data/gsm8k/train.parquet data.val_files=/data/gsm8k/test.parquet \\
    actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct algorithm.adv_estimator=grpo \\
    actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.002 \\
    actor_rollout_ref.actor.kl_loss_type=low_var_kl algorithm.use_kl_in_reward=False \\
    data.train_batch_size=64 data.max_prompt_length=512 data.max_response_length=512 \\
    actor_rollout_ref.rollout.n=4 actor_rollout_ref.actor.ppo_mini_batch_size=16 \\
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 actor_rollout_ref.rollout.name=vllm \\
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 trainer.n_gpus_per_node=4 trainer.nnodes=1 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8
"""

OPENRLHF = """python3 -m openrlhf.cli.train_ppo_ray --actor.num_nodes 1 --actor.num_gpus_per_node 8 \\
  --train.colocate_all --vllm.num_engines 8 --vllm.tensor_parallel_size 1 --vllm.gpu_memory_utilization 0.5 \\
  --actor.model_name_or_path Org/Policy-0.5B --reward.model_name_or_path Org/RM-0.5B \\
  --algo.advantage.estimator gae --train.batch_size 64 --rollout.batch_size 64 --rollout.n_samples_per_prompt 1 \\
  --data.max_len 1024 --rollout.max_new_tokens 512 --ds.zero_stage 2 --algo.kl.init_coef 0.02 \\
  --algo.kl.estimator k2 --data.prompt_dataset /data/prompts.parquet --data.input_key question
"""


@pytest.fixture
def model(tmp_path):
    d = tmp_path / "Qwen2.5-0.5B-Instruct"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(QWEN05))
    return str(d / "config.json")


def _settings(out: str) -> str:
    lines = out.splitlines()
    return "\n".join(lines[lines.index(next(x for x in lines if x.endswith(" settings:"))) + 1:])


def test_verl_line_to_openrlhf_keeps_model_path_data_and_kl(tmp_path, model, capsys):
    script = tmp_path / "run.sh"
    script.write_text(VERL)
    assert main(["plan", "--from-verl", str(script), "--model", model, "--gpu", "h100", "--export", "openrlhf"]) == 0
    out = capsys.readouterr().out
    toks = shlex.split(_settings(out))
    a = vars(openrlhf_parser().parse_args(toks[toks.index("openrlhf.cli.train_ppo_ray") + 1:]))
    # the user's hub name, not --model's config.json (which gave the shapes only)
    assert a["actor.model_name_or_path"] == "Qwen/Qwen2.5-0.5B-Instruct"
    # verl's KL loss (coef 0.002, low_var_kl = k3) is OpenRLHF's --algo.kl.use_loss with the same coefficient
    assert (a["algo.kl.use_loss"], a["algo.kl.init_coef"], a["algo.kl.estimator"]) == (True, 0.002, "k3")
    assert (a["data.prompt_dataset"], a["eval.dataset"]) == ("/data/gsm8k/train.parquet", "/data/gsm8k/test.parquet")
    assert (a["data.input_key"], a["data.apply_chat_template"]) == ("prompt", True)
    # no placeholder: the rule-based reward has no OpenRLHF equivalent and a note says so
    assert a["reward.remote_url"] is None and "REWARD" not in out
    assert "note: verl's rule-based reward" in out
    # vLLM's fraction in whole hundredths, printed as such
    frac = toks[toks.index("--vllm.gpu_memory_utilization") + 1]
    assert frac == str(round(float(frac), 2)) and 0 < float(frac) < 1


def test_openrlhf_line_to_verl_has_model_paths_kl_and_composes(tmp_path, model, capsys):
    script = tmp_path / "train.sh"
    script.write_text(OPENRLHF)  # --from-openrlhf takes a script file, like --from-verl
    assert main(["plan", "--from-openrlhf", str(script), "--model", model, "--gpu", "h100", "--export", "verl"]) == 0
    out = capsys.readouterr().out
    import shlex

    words = shlex.split(_settings(out).replace("\\\n", " "))  # as bash reads the pasted command
    config = next(w for w in words if w.startswith("--config-name=")).split("=", 1)[1]
    ov = words[words.index(f"--config-name={config}") + 1:]
    cfg = load_verl_config(config, ov)  # verl's own config composes with every override
    assert cfg["actor_rollout_ref"]["model"]["path"] == "Org/Policy-0.5B"
    # OpenRLHF's GAE critic defaults to the reward model (train_ppo_ray.py)
    assert cfg["critic"]["model"]["path"] == "Org/RM-0.5B"
    assert cfg["reward"]["reward_model"]["model_path"] == "Org/RM-0.5B"
    # --algo.kl.init_coef 0.02 without --algo.kl.use_loss: a KL penalty in the reward, k2 = verl's mse
    assert cfg["algorithm"]["use_kl_in_reward"] is True and cfg["actor_rollout_ref"]["actor"]["use_kl_loss"] is False
    assert (cfg["algorithm"]["kl_ctrl"]["kl_coef"], cfg["algorithm"]["kl_penalty"]) == (0.02, "mse")
    assert list(cfg["data"]["train_files"]) == ["/data/prompts.parquet"] and cfg["data"]["prompt_key"] == "question"
    assert "deepseek" not in out


def test_carry_notes_where_the_target_has_no_equivalent():
    ov, notes = openrlhf_to_verl({"actor.model_name_or_path": "A", "reward.remote_url": "http://rm:5000",
                                  "data.prompt_dataset": "OpenRLHF/prompt-collection-v0.1", "algo.kl.init_coef": 0.0},
                                 has_critic=True)
    # a remote reward: the critic is the actor (OpenRLHF's rule), no reward model path, a note instead
    assert "critic.model.path=A" in ov and not any(o.startswith("reward.") for o in ov)
    assert any("--reward.remote_url http://rm:5000: verl has no equivalent" in n for n in notes)
    assert any("verl reads parquet files only" in n for n in notes)
    assert "actor_rollout_ref.actor.use_kl_loss=False" in ov
    cfg = load_verl_config("ppo_trainer", ["actor_rollout_ref.actor.use_kl_loss=True",
                                           "actor_rollout_ref.actor.kl_loss_type=abs",
                                           "reward.reward_model.enable=True", "reward.reward_model.model_path=R"])
    toks, notes = verl_to_openrlhf(cfg, has_critic=False)
    assert toks[toks.index("--reward.model_name_or_path") + 1] == "R" and "--algo.kl.estimator" not in toks
    assert any("kl_loss_type=abs" in n and "no equivalent" in n for n in notes)


def test_model_path_of_a_config_json_is_its_folder(model):
    assert export_model_path(model) == model.rsplit("/", 1)[0]
    assert export_model_path("tiny") is None and export_model_path("Org/Name") == "Org/Name"
