"""``nereus plan --framework-version NAME==VERSION``: validated at parse, it selects the imported
framework release's vLLM memory rule (nereus/integrations/framework_versions.py), and it must name
the framework being imported."""

import json

import pytest

from nereus.cli import main
from nereus.cli.plan import framework_version_arg
from nereus.integrations.openrlhf import openrlhf_source
from nereus.integrations.verl_config import verl_config_dir

Q05 = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
       "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768, "tie_word_embeddings": True,
       "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "model_type": "qwen2"}


def test_parse_and_refusals(capsys):
    assert framework_version_arg("verl==0.4.1") == ("verl", "0.4.1")
    assert framework_version_arg("OpenRLHF==0.5.9.post1") == ("openrlhf", "0.5.9.post1")
    for bad, why in (("verl=0.4.1", "NAME==VERSION"), ("trl==0.14", "NAME==VERSION"), ("verl==", "NAME==VERSION"),
                     ("verl==abc", "not a version number")):
        with pytest.raises(SystemExit) as e:  # argparse refuses it at parse
            main(["plan", "--framework-version", bad])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "--framework-version" in err and why in err, err
    # without an import it has nothing to apply to
    assert main(["plan", "--framework-version", "verl==0.4.1"]) == 2
    assert "applies to an imported configuration" in capsys.readouterr().err


@pytest.mark.skipif(verl_config_dir() is None or openrlhf_source() is None, reason="needs verl and OpenRLHF installed")
def test_version_selects_the_vllm_rule(tmp_path, capsys):
    d = tmp_path / "q05"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(Q05))
    line = ["ppo_trainer", "algorithm.adv_estimator=grpo", "data.train_batch_size=64",
            "actor_rollout_ref.actor.ppo_mini_batch_size=32", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4", "actor_rollout_ref.rollout.n=2",
            # verl before 0.4.0 always builds a reference model (verl@072fc9fe), so it needs its micro-batch
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4", f"actor_rollout_ref.model.path={d}"]
    rules = {}
    for v in ("0.4.1", "0.1", None):  # vLLM <= 0.8.5: device_total; TinyZero's verl 0.1: free_share; installed
        flag = ["--framework-version", f"verl=={v}"] if v else []
        assert main(["plan", *flag, "--json", "--from-verl", *line]) == 0
        out = json.loads(capsys.readouterr().out)
        rules[v] = out["job"]["workload"].get("vllm_memory_rule")
        if v == "0.4.1":
            assert any("verl 0.4.1 runs vLLM 0.8.5" in n for n in out["notes"])
    assert rules == {"0.4.1": "device_total", "0.1": "free_share", None: None}  # None: startup_check (verl 0.9.1)
    assert main(["plan", "--framework-version", "openrlhf==0.5.9", "--from-verl", *line]) == 2
    assert "names openrlhf, but --from-verl imports a verl configuration" in capsys.readouterr().err
