"""`nereus run` and `nereus simulate` check their arguments before Ray or a worker starts (issue 17).

Every case here exits with status 2 and one line on stderr before any Ray import; none starts a
worker (the run cases would take tens of seconds and print step lines if they did).
"""

from __future__ import annotations

import pytest

from nereus.cli import main


def _err(capsys, argv):
    rc = main(argv)
    out = capsys.readouterr()
    assert rc == 2, (argv, out)
    assert "Traceback" not in out.err and len(out.err.strip().splitlines()) == 1, out.err
    return out.out, out.err


@pytest.mark.parametrize("argv, words", [
    (["--steps", "0"], ["--steps must be >= 1, got 0"]),
    (["--steps", "-3"], ["--steps must be >= 1, got -3"]),
    (["--workers", "0"], ["--workers must be >= 1"]),
    (["--temperature", "0"], ["--temperature must be a finite number > 0"]),
    (["--kl-coef", "-1"], ["--kl-coef must be a finite number >= 0"]),
    (["--adaptive", "--pool-schedule", "3:-9"],
     ["item '3:-9'", "removes 9 worker(s) before step 3", "only 4 are alive", "at most 3 can leave"]),
    (["--adaptive", "--pool-schedule", "1:-2,3:-2"], ["item '3:-2'", "only 2 are alive"]),
    (["--adaptive", "--pool-schedule", "7:-1"], ["item '7:-1'", "step 7 never runs", "--steps 5"]),
    (["--adaptive", "--pool-schedule", "x"], ["item 'x' must look like 3:-2"]),
    (["--pool-schedule", "1:-1"], ["--pool-schedule needs --adaptive"]),
    (["--model", ""], ["model must be a preset name"]),
    (["--layout", "actor.train=3,1,1"], ["actor.train", "tp=3 does not divide num_attention_heads=4"]),
    (["--layout", "critic.sing=1,1,1"], ["critic.sing", "not in the PPO workflow"]),
    (["--layout", "actor.train=1,1,0"], ["degrees tp, pp, dp must be >= 1"]),
    (["--no-reference", "--kl-coef", "0.1"], ["--kl-coef 0.1 needs the reference model", "--no-reference"]),
    (["--no-reference", "--layout", "reference.infer=1,1,1"], ["reference.infer", "not in the PPO workflow"]),
])
def test_run_refuses_bad_arguments_before_ray(capsys, argv, words):
    out, err = _err(capsys, ["run"] + argv)
    assert out == ""
    for w in words:
        assert w in err, (w, err)


def test_run_memory_check_names_the_worker_budget_and_terms(capsys):
    """Llama-3.1-8B in fp32 is 32 GB of weights: no layout fits 4 workers of 2 GiB; the error comes
    from the cost model with its breakdown, not from a Ray out-of-memory kill."""
    _, err = _err(capsys, ["run", "--model", "llama-3.1-8b", "--steps", "1"])
    assert "llama-3.1-8b with this layout does not fit: worker" in err
    assert "1.80 GiB allowed per worker (--memory-gib 2 less 10% headroom)" in err
    assert "optimizer" in err and "weights" in err
    _, err = _err(capsys, ["run", "--model", "llama-3.1-8b", "--steps", "1", "--adaptive"])
    assert "llama-3.1-8b cannot run on 4 worker(s) of 2 GiB" in err and "even alone" in err


def test_run_help_documents_every_option(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for opt in ("--task", "--ppo-epochs", "--kl-coef", "--temperature", "--seed", "--verbose"):
        line = out.split(opt, 1)[1][:120]
        assert len(line.split()) > 2, opt  # has a help text
    assert "--adaptive the controller" in out and "fixed layout" in out


def test_gpu_help_lists_cpu(capsys):
    for cmd in ("plan", "transition", "simulate"):
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        out = " ".join(capsys.readouterr().out.split())
        assert "cpu" in out.split("--gpu GPU", 2)[-1][:300], cmd


@pytest.mark.parametrize("policies, words", [
    ("nereus,bogus", ["unknown policy 'bogus'", "replan-all"]),
    ("gamma=2", ["policy 'gamma=2'", "[0, 1]"]),
    ("gamma=x", ["policy 'gamma=x'"]),
])
def test_simulate_rejects_unknown_policies_before_any_progress(capsys, tmp_path, policies, words):
    out, err = _err(capsys, ["simulate", "--policies", policies, "--out", str(tmp_path / "o")])
    assert out == ""  # no header, no progress bar
    assert not (tmp_path / "o").exists()
    for w in words:
        assert w in err


# ---- a new user's first hour (issue 30): each refused up front, in one line, before Ray starts
def test_notice_without_a_pool_schedule_is_refused(capsys):
    _, err = _err(capsys, ["run", "--adaptive", "--notice"])
    assert "--notice announces the departures of --pool-schedule" in err


def test_save_onto_an_existing_file_or_the_source_model_directory_is_refused(capsys, tmp_path):
    f = tmp_path / "model.bin"
    f.write_text("x")
    for extra in ([], ["--adaptive"], ["--async"]):
        _, err = _err(capsys, ["run", "--save", str(f), "--steps", "1"] + extra)
        assert f"--save {str(f)!r} is an existing file" in err
    src = tmp_path / "hf"
    src.mkdir()
    import json

    (src / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 256}))
    _, err = _err(capsys, ["run", "--model", str(src), "--save", str(src), "--steps", "1"])
    assert "is the --model directory the run reads its weights from" in err


def test_saving_over_an_earlier_model_removes_its_stale_weights(tmp_path):
    import json

    from nereus.cli.run_save import remove_stale_weights

    d = tmp_path / "out"
    d.mkdir()
    for n in ("model.safetensors", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
              "tokenizer.json"):
        (d / n).write_text("x")
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    assert remove_stale_weights(str(d)) == ["model.safetensors"]  # Transformers would load it first
    assert sorted(p.name for p in d.iterdir()) == ["model-00001-of-00002.safetensors",
                                                   "model-00002-of-00002.safetensors",
                                                   "model.safetensors.index.json", "tokenizer.json"]


def test_run_help_states_the_payback_rule_and_what_resume_steps_count(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "L_tran / ΔL <= γ·H" in out and "(1+γ)" not in out  # the rule admission.payback_ok applies
    assert "--steps N then runs N MORE steps" in out


def test_resume_of_a_missing_checkpoint_and_an_unwritable_dir_are_refused(capsys, tmp_path):
    _, err = _err(capsys, ["run", "--adaptive", "--checkpoint-dir", str(tmp_path), "--resume"])
    assert "no checkpoint in" in err
    f = tmp_path / "f"
    f.write_text("x")
    _, err = _err(capsys, ["run", "--adaptive", "--checkpoint-dir", str(f / "ck"), "--steps", "1"])
    assert "cannot write there" in err
