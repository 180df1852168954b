"""Property-based test: random and malformed arguments and files never end in a traceback (issue 17).

Every sub-command (plan, transition, simulate, run) gets random options and random or corrupted
files, in-process through ``nereus.cli.main``. The outcome must be a clean exit: 0 (or 1, the
documented "nothing fits / infeasible" status of plan and transition), or status 2 with exactly one
line on stderr. ``run`` and ``simulate`` only get inputs that fail validation (they would start Ray
or a simulation otherwise), which is what is under test: everything is checked before they start.
"""

from __future__ import annotations

import contextlib
import io
import json
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nereus.cli import main

JUNK = st.one_of(st.integers(-3, 40), st.text(max_size=6), st.none(), st.booleans(),
                 st.floats(allow_nan=True), st.lists(st.integers(-2, 3), max_size=3),
                 st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
GOOD_JOB = {"model": "tiny", "cluster": {"gpu": "h100", "num_nodes": 1, "gpus_per_node": 4},
            "workload": {"algorithm": "grpo", "prompts_per_step": 8, "samples_per_prompt": 4,
                         "mini_batch_size": 16, "prompt_len": 16, "response_len": 16}}
SETTINGS = settings(max_examples=150, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _call(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse
            rc = e.code if isinstance(e.code, int) else 2
    return rc, out.getvalue(), err.getvalue()


def _clean(argv, rc, err, ok=(0, 1)):
    assert "Traceback" not in err, (argv, err)
    if rc == 2:
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert len(lines) == 1 and "error:" in lines[0], (argv, err)
    else:
        assert rc in ok, (argv, rc, err)


def _mutate(doc, rnd: random.Random, junk):
    """Replace, drop or add one field somewhere in ``doc``."""
    doc = json.loads(json.dumps(doc))
    node = doc
    path = []
    while isinstance(node, (dict, list)) and node and rnd.random() < 0.7:
        key = rnd.choice(list(node)) if isinstance(node, dict) else rnd.randrange(len(node))
        if not isinstance(node[key], (dict, list)):
            break
        path.append(key)
        node = node[key]
    if isinstance(node, dict) and node:
        key = rnd.choice(list(node))
        r = rnd.random()
        if r < 0.6:
            node[key] = junk
        elif r < 0.8:
            del node[key]
        else:
            node["x" + str(key)] = junk
    elif isinstance(node, list) and node:
        node[rnd.randrange(len(node))] = junk
    return doc


@SETTINGS
@given(seed=st.integers(0, 10**6), junk=JUNK)
def test_plan_with_malformed_job_files(tmp_path_factory, seed, junk):
    f = tmp_path_factory.mktemp("fz") / "job.json"
    f.write_text(json.dumps(_mutate(GOOD_JOB, random.Random(seed), junk)))
    argv = ["plan", "--job", str(f), "--json"]
    rc, _, err = _call(argv)
    _clean(argv, rc, err)


OPTS = {"plan": ["--model", "--gpu", "--nodes", "--gpus-per-node", "--prompt-len", "--response-len",
                 "--prompts-per-step", "--samples-per-prompt", "--mini-batch", "--micro-batch", "--ppo-epochs",
                 "--recompute", "--algo", "--pool", "--headroom"],
        "run": ["--steps", "--workers", "--model", "--digits", "--prompts", "--samples", "--mini-batch",
                "--micro-batch", "--ppo-epochs", "--temperature", "--kl-coef", "--lr", "--layout",
                "--pool-schedule", "--memory-gib", "--gamma", "--task", "--algo", "--timeout",
                "--digits-schedule", "--scenario", "--plot"],
        "simulate": ["--policies", "--gammas", "--gamma", "--growth", "--hours", "--nodes", "--model", "--gpu",
                     "--notice", "--jobs", "--trace", "--time-unit"]}
VALUES = st.one_of(st.integers(-5, 9).map(str), st.sampled_from(["", "x", "0", "-1", "1e9", "nan", "3:-9",
                                                                 "actor.train=3,1,1", "bogus", "tiny", "cpu",
                                                                 "gamma=2", "1:2", "a:b:c", "none"]),
                   st.text(alphabet="abc0123,:=-.", max_size=8))


@SETTINGS
@given(pairs=st.lists(st.tuples(st.sampled_from(OPTS["plan"]), VALUES), min_size=1, max_size=3))
def test_plan_with_random_options(pairs):
    argv = ["plan", "--model", "tiny", "--nodes", "1", "--gpus-per-node", "4", "--algo", "grpo",
            "--prompts-per-step", "8", "--mini-batch", "16", "--prompt-len", "16", "--response-len", "16"]
    for k, v in pairs:
        argv += [k, v] if k != "--model" or v in ("tiny", "", "x") else [k, "tiny"]
    rc, _, err = _call(argv + ["--json"])
    _clean(argv, rc, err)


@SETTINGS
@given(pairs=st.lists(st.tuples(st.sampled_from(OPTS["run"]), VALUES), min_size=1, max_size=3))
def test_run_with_random_options_fails_before_ray(pairs):
    # an invalid --steps is always among them, so a valid combination never starts Ray
    argv = ["run"]
    for k, v in pairs:
        argv += [k, v]
    argv += ["--steps", "0"]
    rc, out, err = _call(argv)
    assert rc == 2 and "step=" not in out, (argv, rc, out, err)
    _clean(argv, rc, err)


@SETTINGS
@given(pairs=st.lists(st.tuples(st.sampled_from(OPTS["simulate"]), VALUES), min_size=1, max_size=3))
def test_simulate_with_random_options_fails_before_any_progress(pairs, tmp_path_factory):
    argv = ["simulate"]
    for k, v in pairs:
        argv += [k, v]
    argv += ["--policies", "nereus,bogus", "--out", str(tmp_path_factory.mktemp("sim") / "o")]
    rc, out, err = _call(argv)
    assert rc == 2 and "━" not in out, (argv, out)
    _clean(argv, rc, err)


PLAN = {"plan": {"candidates": [
    {"model_stage": "actor.train", "tp": 2, "pp": 1, "dp": 2, "micro_batch": 4, "grad_accum": 2,
     "recompute": "none", "concurrency": 0, "gpus": [0, 1, 2, 3]},
    {"model_stage": "reference.infer", "tp": 1, "pp": 1, "dp": 2, "micro_batch": 4, "grad_accum": 0,
     "recompute": "none", "concurrency": 0, "gpus": [2, 3]}]}, "job": GOOD_JOB, "feasible": True}


@SETTINGS
@given(seed=st.integers(0, 10**6), junk=JUNK, which=st.sampled_from(["from", "to", "both"]))
def test_transition_with_malformed_plan_files(tmp_path_factory, seed, junk, which):
    d = tmp_path_factory.mktemp("tr")
    rnd = random.Random(seed)
    a, b = d / "a.json", d / "b.json"
    a.write_text(json.dumps(_mutate(PLAN, rnd, junk) if which in ("from", "both") else PLAN))
    b.write_text(json.dumps(_mutate(PLAN, rnd, junk) if which in ("to", "both") else PLAN))
    if rnd.random() < 0.1:
        b.write_text(b.read_text()[: rnd.randrange(1, 40)])  # truncated JSON
    argv = ["transition", "--from", str(a), "--to", str(b)]
    rc, _, err = _call(argv)
    _clean(argv, rc, err)
