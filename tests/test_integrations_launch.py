"""What a user pastes: verl launch lines and scripts unedited (Hydra overrides in any order,
``--config-name``, ``python3 -m verl.trainer.main_ppo``), OpenRLHF command lines, exports that keep the
user's settings and compose with the frameworks' own configuration, and empty inputs refused."""

import json
import shlex

import pytest
from test_integrations_framework_checks import MEGATRON

from nereus.cli import main
from nereus.integrations.openrlhf import import_openrlhf, openrlhf_parser, openrlhf_source
from nereus.integrations.verl import import_verl
from nereus.integrations.verl_config import load_verl_config, verl_config_dir, verl_launch

pytestmark = pytest.mark.skipif(verl_config_dir() is None or openrlhf_source() is None,
                                reason="needs verl and OpenRLHF installed")

Q05 = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
       "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768, "tie_word_embeddings": True,
       "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "model_type": "qwen2"}

# verl's examples/grpo_trainer style launch script, unedited shell (variables, continuations, $@)
SCRIPT = """set -x

gsm8k_train_path=$HOME/data/gsm8k/train.parquet
train_files="['$gsm8k_train_path']"

python3 -m verl.trainer.main_ppo \\
    algorithm.adv_estimator=grpo \\
    data.train_files="$train_files" \\
    data.val_files=$HOME/data/gsm8k/test.parquet \\
    data.train_batch_size=256 \\
    data.max_prompt_length=512 \\
    data.max_response_length=1024 \\
    actor_rollout_ref.model.path={model} \\
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \\
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \\
    actor_rollout_ref.actor.use_kl_loss=True \\
    actor_rollout_ref.actor.kl_loss_coef=0.001 \\
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 \\
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \\
    actor_rollout_ref.rollout.name=vllm \\
    actor_rollout_ref.rollout.gpu_memory_utilization=0.5 \\
    actor_rollout_ref.rollout.n=4 \\
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16 \\
    trainer.logger='["console","wandb"]' \\
    trainer.n_gpus_per_node=8 \\
    trainer.nnodes=1 $@
"""


@pytest.fixture
def model(tmp_path):
    d = tmp_path / "Qwen2.5-0.5B"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(Q05))
    return str(d)


def test_script_line_and_overrides_in_any_order_import_alike(tmp_path, model, monkeypatch):
    monkeypatch.setenv("HOME", "/home/u")
    sh = tmp_path / "run_qwen.sh"
    sh.write_text(SCRIPT.format(model=model))
    config, overrides, _ = verl_launch([str(sh)])
    assert config == "ppo_trainer"  # verl's main_ppo default
    assert "data.train_files=['/home/u/data/gsm8k/train.parquet']" in overrides
    line = "HYDRA_FULL_ERROR=1 python3 -m verl.trainer.main_ppo --config-name=ppo_trainer " + " ".join(
        shlex.quote(o) for o in reversed(overrides)) + " 2>&1 | tee log.txt"
    a = import_verl(load_verl_config(str(sh)))
    b = import_verl(load_verl_config(line))
    assert a.layout == b.layout and a.job.workload == b.job.workload and a.expressible
    with pytest.raises(ValueError, match="empty"):
        verl_launch([])
    with pytest.raises(ValueError, match="not an option of verl's launcher"):
        verl_launch(["python3", "-m", "verl.trainer.main_ppo", "--bogus", "a=1"])


def test_cli_export_keeps_the_users_settings_and_round_trips(tmp_path, model, capsys, monkeypatch):
    monkeypatch.setenv("HOME", "/home/u")
    sh = tmp_path / "run_qwen.sh"
    sh.write_text(SCRIPT.format(model=model))
    _, overrides, _ = verl_launch([str(sh)])
    # --export before the overrides, the launch line's own tokens after it
    rc = main(["plan", "--export", "verl", "--json", "--from-verl", "python3", "-m", "verl.trainer.main_ppo",
               *overrides])
    out = capsys.readouterr()
    assert rc == 0, out.err
    ex = json.loads(out.out)
    ov = ex["overrides"]
    assert ex["config_name"] == "ppo_trainer" and ex["backend"] == "fsdp"  # the user's FSDP backend
    for kept in ("data.train_files=['/home/u/data/gsm8k/train.parquet']", f"actor_rollout_ref.model.path={model}",
                 "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.001",
                 "actor_rollout_ref.rollout.name=vllm", "data.val_files=/home/u/data/gsm8k/test.parquet"):
        assert kept in ov, kept
    assert not any(".megatron." in o for o in ov)
    # verl's own config composes with the export, and importing it back gives the exported layout
    back = import_verl(load_verl_config(ex["config_name"], ov))
    assert back.expressible and back.job.workload.lora_rank is None
    keys = ("tp", "pp", "dp", "micro_batch", "grad_accum", "recompute", "concurrency", "zero", "offload", "vpp")
    got = {c.model_stage: tuple(getattr(c, k) for k in keys) for c in back.layout}
    want = {n: tuple(m[k] for k in keys) for n, m in ex["evaluation"]["model_stages"].items()}
    assert got == want
    frac = float(next(o for o in ov if ".rollout.gpu_memory_utilization=" in o).split("=")[1])
    assert back.job.workload.rollout_memory_fraction == frac

OPENRLHF = ("python3 -m openrlhf.cli.train_ppo_ray --actor.num_nodes 1 --actor.num_gpus_per_node 8 "
            "--ref.num_nodes 1 --ref.num_gpus_per_node 8 --vllm.num_engines 8 --vllm.tensor_parallel_size 1 "
            "--train.colocate_all --vllm.enable_sleep --ds.enable_sleep --vllm.gpu_memory_utilization 0.6 "
            "--actor.model_name_or_path {model} --reward.remote_url http://rm:5000/get_reward "
            "--algo.advantage.estimator group_norm --rollout.n_samples_per_prompt 8 --rollout.batch_size 128 "
            "--train.batch_size 128 --train.micro_batch_size 4 --rollout.micro_batch_size 8 --data.max_len 3072 "
            "--rollout.max_new_tokens 2048 --ds.zero_stage 3 --data.prompt_dataset my/prompts --algo.kl.init_coef 0.001 "
            "--actor.gradient_checkpointing_enable")


def test_openrlhf_export_keeps_paths_and_parses(model, capsys):
    line = OPENRLHF.format(model=model)
    rc = main(["plan", "--from-openrlhf", line, "--export", "openrlhf", "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    args = json.loads(out.out)["args"]
    for kept in (["--actor.model_name_or_path", model], ["--reward.remote_url", "http://rm:5000/get_reward"],
                 ["--data.prompt_dataset", "my/prompts"], ["--algo.kl.init_coef", "0.001"]):
        i = args.index(kept[0])
        assert args[i:i + 2] == kept
    assert "REWARD_FN_OR_URL" not in args and "REWARD_MODEL_PATH" not in args
    openrlhf_parser().parse_args(args)  # OpenRLHF's own parser takes it
    back = import_openrlhf(shlex.join(args))
    assert back.expressible


def test_empty_inputs_are_refused(capsys):
    assert main(["plan", "--from-openrlhf", ""]) == 2
    assert "empty" in capsys.readouterr().err


ARRAY_SCRIPT = """#!/usr/bin/env bash
max_prompt_length=$((512 * 2))
max_response_length=$(( (1024 + 1024) / 2 ))
DATA=(
    data.train_files=$HOME/data/gsm8k/train.parquet
    data.max_prompt_length=$max_prompt_length
    data.max_response_length=$max_response_length
    data.train_batch_size=256
    # a comment inside the array (with parentheses) is skipped
)
MODEL=( actor_rollout_ref.model.path={model} )
ACTOR=(
    actor_rollout_ref.actor.ppo_mini_batch_size=64
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8
)
ACTOR+=(actor_rollout_ref.actor.use_kl_loss=True)
python3 -m verl.trainer.main_ppo \\
    algorithm.adv_estimator=grpo "${{DATA[@]}}" "${{MODEL[@]}}" \\
    "${{ACTOR[@]}}" \\
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 actor_rollout_ref.rollout.n=4 \\
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16 trainer.n_gpus_per_node=8 trainer.nnodes=1 "$@"
"""


def test_script_bash_arrays_and_arithmetic_expand(tmp_path, model, monkeypatch):
    # verl's newer example scripts group overrides in bash arrays (run_qwen2-7b_math_megatron_lora.sh)
    monkeypatch.setenv("HOME", "/home/u")
    sh = tmp_path / "run_arrays.sh"
    sh.write_text(ARRAY_SCRIPT.format(model=model))
    config, overrides, _ = verl_launch([str(sh)])
    assert config == "ppo_trainer"
    assert overrides == ["algorithm.adv_estimator=grpo", "data.train_files=/home/u/data/gsm8k/train.parquet",
                         "data.max_prompt_length=1024",
                         "data.max_response_length=1024", "data.train_batch_size=256",
                         f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.actor.ppo_mini_batch_size=64",
                         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
                         "actor_rollout_ref.actor.use_kl_loss=True",
                         "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16", "actor_rollout_ref.rollout.n=4",
                         "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16", "trainer.n_gpus_per_node=8",
                         "trainer.nnodes=1"]
    imp = import_verl(load_verl_config(str(sh)))
    assert imp.expressible and (imp.job.workload.prompt_len, imp.job.workload.response_len) == (1024, 1024)


def test_shell_word_reaches_verl_unchanged_through_bash(tmp_path):
    import subprocess

    from nereus.integrations.verl_command import shell_word, verl_command

    toks = ["data.train_files=['/root/data/gsm8k/train.parquet', '/root/data/math/train.parquet']",
            'trainer.logger=["console","wandb"]', "trainer.experiment_name=a$b", "trainer.nnodes=1"]
    assert shell_word("trainer.nnodes=1") == "trainer.nnodes=1"  # nothing special: as written
    assert shell_word(toks[0]) == f'"{toks[0]}"'
    # bash itself (word splitting, [..] globs) hands every word back as written; a file matching the
    # glob's characters is present so an unquoted [..] would expand
    (tmp_path / "trainer.logger=c").write_text("")
    out = subprocess.run(["bash", "-c", "printf '%s\\n' " + " ".join(shell_word(t) for t in toks)], cwd=tmp_path,
                         capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == toks
    assert shlex.split(verl_command("ppo_trainer", toks).replace("\\\n", " "))[4:] == toks


def test_cli_export_line_pasted_into_bash_composes_a_list_of_files(capsys):
    """shlex.split of the printed command (bash's word splitting) composed with verl's own config:
    the two-element data.train_files and the logger list arrive whole."""
    files = "data.train_files=['/root/data/gsm8k/train.parquet', '/root/data/math/train.parquet']"
    line = ["ppo_trainer", "algorithm.adv_estimator=grpo", "data.train_batch_size=256", "data.max_prompt_length=512",
            "data.max_response_length=1024", "actor_rollout_ref.actor.ppo_mini_batch_size=64",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.actor.use_kl_loss=True",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16", "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16", "trainer.n_gpus_per_node=8",
            files, 'trainer.logger=["console","wandb"]']
    assert main(["plan", "--from-verl", *line, "--model", "qwen2.5-0.5b", "--export", "verl", "--json"]) == 0
    ex = json.loads(capsys.readouterr().out)
    toks = shlex.split(ex["command"].replace("\\\n", " "))
    config, overrides, _ = verl_launch(toks)
    from nereus.integrations.verl_config import _compose_raw

    cfg = _compose_raw(verl_config_dir(), config, overrides)
    assert cfg["data"]["train_files"] == ["/root/data/gsm8k/train.parquet", "/root/data/math/train.parquet"]
    assert cfg["trainer"]["logger"] == ["console", "wandb"]
    assert overrides == ex["overrides"]


QWEN2_7B = {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
            "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
            "max_position_embeddings": 32768, "rope_theta": 1000000.0, "tie_word_embeddings": False,
            "rms_norm_eps": 1e-6}
# verl examples/grpo_trainer/run_qwen2-7b.sh (the hybrid engine: every model-stage on the 8 GPUs)
GRPO_7B = ["algorithm.adv_estimator=grpo", "data.train_batch_size=1024", "data.max_prompt_length=512",
           "data.max_response_length=1024", "actor_rollout_ref.actor.ppo_mini_batch_size=256",
           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40", "actor_rollout_ref.actor.use_kl_loss=True",
           "actor_rollout_ref.model.enable_gradient_checkpointing=True",
           "actor_rollout_ref.actor.fsdp_config.param_offload=False",
           "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
           "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40",
           "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.name=vllm",
           "actor_rollout_ref.rollout.gpu_memory_utilization=0.6", "actor_rollout_ref.rollout.n=5",
           "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40", "actor_rollout_ref.ref.fsdp_config.param_offload=True",
           "trainer.n_gpus_per_node=8", "trainer.nnodes=1"]


def test_colocated_export_round_trips_with_the_same_fits_and_peak(tmp_path, capsys):
    """import(export(plan)): the export predicts vLLM holding the gpu_memory_utilization it writes
    (through training unless free_cache_engine), as the import evaluates it, so the verdict and each
    model-stage's per-GPU peak come back equal."""
    from nereus.planner.whatif import evaluate_layout

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(QWEN2_7B))
    assert main(["plan", "--from-verl", "ppo_trainer", *GRPO_7B, "--model", str(cfg), "--gpu", "h100",
                 "--export", "verl", "--json"]) == 0
    ex = json.loads(capsys.readouterr().out)
    ev = ex["evaluation"]
    toks = shlex.split(ex["command"].replace("\\\n", " "))
    back = import_verl(load_verl_config(" ".join(shlex.quote(t) for t in toks)), model=str(cfg), gpu="h100")
    assert back.expressible
    again = evaluate_layout(back.job, back.layout).to_dict()
    assert again["fits"] == ev["fits"]
    assert again["l_step"] == pytest.approx(ev["l_step"], rel=1e-9)
    for name, m in ev["model_stages"].items():
        assert again["model_stages"][name]["peak_gib"] == pytest.approx(m["peak_gib"], rel=1e-9), name
    frac = float(next(o for o in ex["overrides"] if ".rollout.gpu_memory_utilization=" in o).split("=")[1])
    assert back.job.workload.rollout_memory_fraction == frac == round(frac, 2)


def test_empty_verl_input_is_refused_by_name(capsys):
    for toks in ([""], ["  "]):
        with pytest.raises(ValueError, match="--from-verl: empty"):
            verl_launch(toks)
    assert main(["plan", "--from-verl", ""]) == 2
    assert "--from-verl: empty" in capsys.readouterr().err


def test_script_then_overrides_appended_later_wins(tmp_path, model, monkeypatch):
    """verl's scripts end in $@: overrides after the script go there, after the script's own (Hydra
    applies overrides in order, the last value of a key wins); a pipe after $@ stays out."""
    monkeypatch.setenv("HOME", "/home/u")
    sh = tmp_path / "run_qwen.sh"
    sh.write_text(SCRIPT.format(model=model).replace(" $@", " $@ 2>&1 | tee log.txt"))
    _, overrides, _ = verl_launch([str(sh), "data.max_response_length=4000", "trainer.nnodes=2"])
    assert overrides[-2:] == ["data.max_response_length=4000", "trainer.nnodes=2"]
    assert "data.max_response_length=1024" in overrides and "tee" not in overrides
    d = load_verl_config(str(sh), ["data.max_response_length=4000"])
    assert d["data"]["max_response_length"] == 4000 and d["data"]["max_prompt_length"] == 512


def test_config_name_option_first_after_from_verl(capsys):
    from nereus.cli import _verl_entry

    argv = ["plan", "--from-verl", "--config-name=ppo_megatron_trainer", "trainer.nnodes=1"]
    assert _verl_entry(argv) == ["plan", "--from-verl", "verl.trainer.main_ppo", *argv[2:]]
    assert _verl_entry(["plan", "--from-verl", "ppo_trainer"]) == ["plan", "--from-verl", "ppo_trainer"]
    line = ["--config-name=ppo_megatron_trainer", *MEGATRON_8B]
    assert main(["plan", "--from-verl", *line, "--model", "llama-3.1-8b", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["job"]["framework"]["name"] == "verl-megatron"


MEGATRON_8B = MEGATRON[1:]  # the Megatron 8B line of the framework-check tests, without its config name


def test_typo_key_suggests_the_key_verl_has_and_plus_unknown_is_warned(model, capsys):
    # one letter dropped: verl has the key, so no word about another verl release
    with pytest.raises(ValueError, match=r"unknown key actor_rollout_ref\.rollout\.tensor_model_paralel_size; "
                                         r"did you mean `actor_rollout_ref\.rollout\.tensor_model_parallel_size`\?"):
        load_verl_config("ppo_trainer", ["actor_rollout_ref.rollout.tensor_model_paralel_size=2"])
    # nothing close: the other-release hint stays
    with pytest.raises(ValueError, match="another verl version"):
        load_verl_config("ppo_trainer", ["actor_rollout_ref.rollout.zzzz=2"])
    # +key adds it (Hydra) but verl never reads it: named unknown, never silently "ignored"
    cfg = load_verl_config("ppo_trainer", ["+actor_rollout_ref.rollout.tensor_model_paralel_size=2",
                                           "+actor_rollout_ref.actor.megatron.override_ddp_config.x=1"])
    assert cfg.unknown == (("actor_rollout_ref.rollout.tensor_model_paralel_size",
                            "actor_rollout_ref.rollout.tensor_model_parallel_size"),)  # free-form dicts take any
    rc = main(["plan", "--from-verl", "ppo_trainer", *FSDP_SMALL, f"actor_rollout_ref.model.path={model}",
               "+actor_rollout_ref.rollout.tensor_model_paralel_size=2", "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    notes = json.loads(out.out)["notes"]
    hit = [n for n in notes if "tensor_model_paralel_size" in n]
    assert len(hit) == 1 and "unknown key to verl" in hit[0] and "ignored" not in hit[0]
    assert "did you mean `actor_rollout_ref.rollout.tensor_model_parallel_size`" in hit[0]


FSDP_SMALL = ["algorithm.adv_estimator=grpo", "data.train_batch_size=256", "data.max_prompt_length=512",
              "data.max_response_length=1024", "actor_rollout_ref.actor.ppo_mini_batch_size=64",
              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.actor.use_kl_loss=True",
              "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16", "actor_rollout_ref.rollout.n=4",
              "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16", "trainer.n_gpus_per_node=8"]


def test_rollout_names_verl_does_not_have_are_refused_and_sglang_noted(model, capsys):
    from nereus.integrations.verl_names import rollout_names

    # verl 0.9.1 verl/workers/rollout/base.py _ROLLOUT_REGISTRY: vllm, sglang, trtllm (no hf any more)
    assert set(rollout_names()) == {"vllm", "sglang", "trtllm"}
    for bad in ("foo", "hf"):
        with pytest.raises(ValueError, match=rf"actor_rollout_ref\.rollout\.name='{bad}': .*no such rollout engine "
                                             r"\(valid: vllm, sglang, trtllm\)"):
            load_verl_config("ppo_trainer", [f"actor_rollout_ref.rollout.name={bad}"])
    rc = main(["plan", "--from-verl", "ppo_trainer", *FSDP_SMALL, f"actor_rollout_ref.model.path={model}",
               "actor_rollout_ref.rollout.name=sglang", "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert any("rollout.name='sglang': timed and sized with vLLM's model" in n for n in json.loads(out.out)["notes"])
