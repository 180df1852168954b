"""Every file the CLI reads is checked (docs/files.md): one-line errors that name the field, the
value and what is valid; plan files against their jobs and each other (issue 17)."""

from __future__ import annotations

import json

import pytest

from nereus.cli import main
from nereus.planner.notation import format_candidate, format_gpus, format_plan
from nereus.spec.plan import Candidate, Plan
from nereus.spec.presets import get_model

CLUSTER = {"gpu": "h100", "num_nodes": 1, "gpus_per_node": 8}


def _run(capsys, argv):
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _one_line_error(rc, err, *words):
    assert rc == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for w in words:
        assert w in err, (w, err)


@pytest.mark.parametrize("doc, words", [
    ({"model": "tiny", "cluster": {"gpu": "h100", "gpus_per_node": 8}}, ["num_nodes", "missing"]),
    ({"model": 5, "cluster": CLUSTER}, ["'model'", "got 5", "preset name"]),
    ({"model": "tiny", "cluster": [1, 2]}, ["'cluster'", "[1, 2]", "num_nodes"]),
    ({"model": "tiny", "cluster": {"gpu": {"name": "x"}, "num_nodes": 1, "gpus_per_node": 8}},
     ["custom GPU 'x'", "peak_flops", "h100"]),
    ({"model": "tiny", "cluster": CLUSTER, "workload": {"reward_model": "no"}}, ["reward_model", "'no'", "boolean"]),
    ({"model": "tiny", "cluster": CLUSTER, "extra": 1}, ["unknown job section", "extra"]),
    ([1, 2], ["mapping"]),
])
def test_bad_job_files_give_one_line_errors(tmp_path, capsys, doc, words):
    f = tmp_path / "job.json"
    f.write_text(json.dumps(doc))
    _one_line_error(*_run(capsys, ["plan", "--job", str(f)])[::2], *words)


def test_string_boolean_in_config_is_refused_and_model_dirs_work(tmp_path, capsys):
    cfg = get_model("tiny").to_hf_config() | {"tie_word_embeddings": "false"}
    d = tmp_path / "mymodel"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    _one_line_error(*_run(capsys, ["plan", "--model", str(d)])[::2], "'tie_word_embeddings'", "'false'",
                    "JSON boolean")
    (d / "config.json").write_text(json.dumps(cfg | {"tie_word_embeddings": False}))
    rc, out, _ = _run(capsys, ["plan", "--model", str(d), "--nodes", "1", "--json"])
    assert rc == 0 and json.loads(out)["job"]["model"]["name"] == "mymodel"
    _one_line_error(*_run(capsys, ["plan", "--model", str(tmp_path)])[::2], "holds no config.json")
    _one_line_error(*_run(capsys, ["plan", "--model", ""])[::2], "model must be a preset name")


def test_plan_json_output_is_a_job_file(tmp_path, capsys):
    rc, out, _ = _run(capsys, ["plan", "--model", "tiny", "--nodes", "1", "--gpus-per-node", "4", "--json"])
    assert rc == 0
    f = tmp_path / "p.json"
    f.write_text(out)
    rc, out2, _ = _run(capsys, ["plan", "--job", str(f), "--json"])
    assert rc == 0 and json.loads(out2)["job"] == json.loads(out)["job"]


def test_no_plan_fits_says_memory_is_the_cause(capsys):
    # 4 GPUs is the smallest layout count of a stage for Llama-3.1-8B PPO, so memory, not GPU count,
    # is what does not fit
    # (in the paper's disjoint space: the default, runtime, space fits it by colocation and ZeRO-1)
    rc, _, err = _run(capsys, ["plan", "--nodes", "1", "--gpus-per-node", "4", "--framework", "nereus"])
    assert rc == 1 and "need 4 GPU(s), which the pool has" in err and "memory is the cause" in err


@pytest.fixture(scope="module")
def grown(tmp_path_factory):
    """`nereus plan --nodes 2 --json` and `--nodes 4 --json` outputs (16 -> 32 H100s)."""
    d = tmp_path_factory.mktemp("plans")
    paths = []
    for nodes in (2, 4):
        p = d / f"n{nodes}.json"
        import contextlib
        import io
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main(["plan", "--nodes", str(nodes), "--json"]) == 0
        p.write_text(buf.getvalue())
        paths.append(p)
    return paths


def test_transition_between_plans_of_two_cluster_sizes_uses_their_jobs(grown, capsys):
    a, b = grown
    rc, out, err = _run(capsys, ["transition", "--from", str(a), "--to", str(b)])
    assert rc == 0, err
    assert "on 32 x h100 (4 node(s) x 8); pool: all 32 GPUs" in out
    # the default (runtime) plans drop the generation copies between runs (off:drop: nothing to
    # Extend) and grow the inference replicas by Extend onto the new GPUs
    assert "L_tran = " in out and "local DAGs" in out and "extend:critic.infer" in out
    # the GPU ids of the larger plan appear in the DAG's text
    assert "tp4 pp1 dp4 off:drop on GPUs 0-15 -> tp4 pp1 dp8 off:drop on GPUs 0-31" in out
    rc, out, _ = _run(capsys, ["transition", "--from", str(b), "--to", str(a), "--pool", "16"])
    assert rc == 1 and "outside the pool" in out


def _edited(src, tmp_path, edit, name="edited.json"):
    doc = json.loads(src.read_text())
    edit(doc)
    p = tmp_path / name
    p.write_text(json.dumps(doc))
    return p


def _cand(doc, ms):
    return next(c for c in doc["plan"]["candidates"] if c["model_stage"] == ms)


def test_hand_edited_plans_are_checked_against_their_jobs(grown, tmp_path, capsys):
    a, b = grown
    cases = [
        # Llama-3.1-8B has 32 query heads
        (lambda d: _cand(d, "actor.infer").update(tp=3, dp=4, gpus=list(range(12))),
         ["actor.infer", "tp=3 does not divide num_attention_heads=32"]),
        (lambda d: _cand(d, "actor.train").update(grad_accum=_cand(d, "actor.train")["grad_accum"] - 1),
         ["actor.train", "must equal the job's mini_batch_size 256"]),
        (lambda d: _cand(d, "critic.train").update(gpus=[99] + _cand(d, "critic.train")["gpus"][1:]),
         ["critic.train", "[99]", "outside its cluster's 0..31"]),
        (lambda d: _cand(d, "actor.train").update(tp="2"), ["'tp'", "'2'", "integer"]),
        (lambda d: d["plan"]["candidates"].append({"model_stage": "actor.sing", "tp": 1, "pp": 1, "dp": 1}),
         ["model_stage", "stage must be one of"]),
        (lambda d: d["plan"].pop("candidates"), ["no 'candidates' list"]),
    ]
    for edit, words in cases:
        p = _edited(b, tmp_path, edit)
        rc, _, err = _run(capsys, ["transition", "--from", str(a), "--to", str(p)])
        if "stage must be one of" in words:
            assert rc == 2 and "Traceback" not in err
            continue
        _one_line_error(rc, err, *words)


def test_hand_edited_tp_for_a_28_head_model_is_refused(tmp_path, capsys):
    cfg = get_model("tiny").to_hf_config() | {"num_attention_heads": 28, "num_key_value_heads": 4,
                                              "hidden_size": 448, "head_dim": 16, "intermediate_size": 896}
    (tmp_path / "m.json").write_text(json.dumps(cfg))
    rc, out, _ = _run(capsys, ["plan", "--model", str(tmp_path / "m.json"), "--nodes", "1", "--json"])
    assert rc == 0
    src = tmp_path / "p.json"
    src.write_text(out)
    p = _edited(src, tmp_path, lambda d: _cand(d, "reference.infer").update(tp=8, dp=1, pp=1,
                                                                             gpus=list(range(8))))
    _one_line_error(*_run(capsys, ["transition", "--from", str(src), "--to", str(p)])[::2],
                    "tp=8 does not divide num_attention_heads=28")


def test_plans_of_different_models_are_refused(grown, tmp_path, capsys):
    a, _ = grown
    rc, out, _ = _run(capsys, ["plan", "--model", "qwen3-14b", "--nodes", "2", "--json"])
    assert rc == 0
    q = tmp_path / "q.json"
    q.write_text(out)
    _one_line_error(*_run(capsys, ["transition", "--from", str(a), "--to", str(q)])[::2],
                    "plans of different models", "llama-3.1-8b vs qwen3-14b")
    p = _edited(a, tmp_path, lambda d: d["job"]["workload"].update(mini_batch_size=512))
    _one_line_error(*_run(capsys, ["transition", "--from", str(a), "--to", str(p)])[::2],
                    "different workloads: mini_batch_size = 256 vs 512")


def test_infeasible_plan_output_and_garbage_are_refused_as_plans(tmp_path, capsys):
    f = tmp_path / "x.json"
    f.write_text(json.dumps({"feasible": False, "reason": "no plan fits: x\n  more", "job": {}}))
    _one_line_error(*_run(capsys, ["transition", "--from", str(f), "--to", str(f)])[::2],
                    "holds no plan", "no plan fits: x")
    f.write_text("{not json")
    _one_line_error(*_run(capsys, ["transition", "--from", str(f), "--to", str(f)])[::2], "not valid JSON")
    _one_line_error(*_run(capsys, ["transition", "--from", str(tmp_path), "--to", str(f)])[::2],
                    "does not exist", "directory")


def test_argparse_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--nodes", "x"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and "invalid int value: 'x'" in err


def test_notation():
    c = Candidate("actor.train", 2, 1, 4, micro_batch=2, grad_accum=32, gpus=tuple(range(8)))
    assert format_candidate(c) == "tp2 pp1 dp4 on workers 0-7"
    assert format_candidate(c, "GPUs", batch=True) == "tp2 pp1 dp4 (b2 a32) on GPUs 0-7"
    assert format_gpus([8, 0, 1, 2, 3, 10, 11]) == "0-3,8,10-11" and format_gpus([]) == "-"
    g = Candidate("actor.generate", 1, 1, 2, concurrency=64, gpus=(4, 5))
    assert format_plan(Plan((g, c))) == ("actor.generate  tp1 pp1 dp2 on workers 4-5\n"
                                         "actor.train     tp2 pp1 dp4 on workers 0-7")
    assert format_candidate(Candidate("x.infer", 1, 1, 1)) == "tp1 pp1 dp1"


def test_an_abbreviated_or_unknown_option_names_the_sub_command(capsys):
    """``--gpus`` is not an abbreviation of ``--gpus-per-node`` (it used to be taken as one)."""
    with pytest.raises(SystemExit) as e:
        main(["plan", "--gpus", "16"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "nereus plan: error: unrecognized arguments: --gpus 16 (nereus plan --help lists the options)" in err
