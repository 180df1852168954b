"""``nereus plan --from-verl`` with job options: options the configuration also sets must agree with it,
and ``--prompt-len``/``--response-len`` are means at most the configuration's maxima (issue 28: "empty
or contradictory inputs refused")."""

import json

import pytest

from nereus.cli import main
from nereus.integrations.verl_config import verl_config_dir

Q05 = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
       "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768, "tie_word_embeddings": True,
       "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "model_type": "qwen2"}

pytestmark = pytest.mark.skipif(verl_config_dir() is None, reason="needs verl installed")


def _line(tmp_path):
    d = tmp_path / "q05"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(Q05))
    return ["ppo_trainer", "algorithm.adv_estimator=grpo", "data.train_batch_size=64", "data.max_prompt_length=512",
            "data.max_response_length=1024", "actor_rollout_ref.actor.ppo_mini_batch_size=32",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4", "actor_rollout_ref.rollout.n=2",
            "trainer.n_gpus_per_node=4", "trainer.nnodes=1", f"actor_rollout_ref.model.path={d}"]


@pytest.mark.parametrize("opt, value, imported", [(["--nodes", "2"], "2", "1"), (["--gpus-per-node", "8"], "8", "4"),
                                                  (["--algo", "remax"], "remax", "grpo")])
def test_contradicting_job_options_are_refused(tmp_path, capsys, opt, value, imported):
    assert main(["plan", *opt, "--from-verl", *_line(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{opt[0]} {value} contradicts the imported verl configuration, which sets {imported}" in err, err


def test_agreeing_options_and_mean_lengths(tmp_path, capsys):
    # the configuration's own values are accepted; a mean length below the maximum is used and noted
    assert main(["plan", "--json", "--nodes", "1", "--gpus-per-node", "4", "--algo", "grpo", "--prompt-len", "100",
                 "--from-verl", *_line(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["job"]["workload"]["prompt_len"] == 100 and out["job"]["workload"]["response_len"] == 1024
    assert any("--prompt-len 100: the mean length used" in n and "maximum is 512" in n for n in out["notes"])
    # a mean above the maximum is refused, with the valid range
    assert main(["plan", "--prompt-len", "4096", "--from-verl", *_line(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--prompt-len 4096 is longer than the imported configuration's maximum of 512 tokens" in err
    assert "valid: 1-512" in err
