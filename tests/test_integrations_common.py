"""The exact combination of colocated options used by the exports (best_colocated) against brute force."""

import itertools
import random

import pytest

from nereus.integrations.common import best_colocated, pareto


def _brute(groups, usable):
    best = None
    for combo in itertools.product(*groups):
        if sum(o[1] for o in combo) + max(o[2] for o in combo) > usable:
            continue
        t = sum(o[0] for o in combo)
        if best is None or t < best:
            best = t
    return best


@pytest.mark.parametrize("seed", range(40))
def test_best_colocated_is_the_brute_force_optimum(seed):
    rng = random.Random(seed)
    groups = [[(rng.uniform(1, 10), rng.uniform(0, 40), rng.uniform(0, 40), (g, i)) for i in range(rng.randint(1, 6))]
              for g in range(rng.randint(1, 4))]
    usable = rng.uniform(20, 120)
    want = _brute(groups, usable)
    got = best_colocated(groups, usable)
    if want is None:
        assert got is None
        return
    assert got[0] == pytest.approx(want)
    picked = [next(o for o in g if o[3] == p) for g, p in zip(groups, got[1])]
    assert sum(o[0] for o in picked) == pytest.approx(want)
    assert sum(o[1] for o in picked) + max(o[2] for o in picked) <= usable + 1e-9
    # pruning each group to its Pareto options first keeps the optimum
    assert best_colocated([pareto(g) for g in groups], usable)[0] == pytest.approx(want)


def test_best_colocated_hand_case():
    # two groups: fast-but-big (1 s, 30 resident) or slow-but-small (3 s, 5 resident), transients 10;
    # 50 usable: both fast would need 30 + 30 + 10 = 70, so one fast one slow: 4 s
    g = [(1.0, 30.0, 10.0, "fast"), (3.0, 5.0, 10.0, "slow")]
    t, picks = best_colocated([g, g], 50.0)
    assert t == pytest.approx(4.0) and sorted(picks) == ["fast", "slow"]
    assert best_colocated([g, g], 19.0) is None  # 5 + 5 + 10 = 20 > 19


def test_launch_lines_shlex_cannot_split_are_named_with_the_cause(tmp_path, capsys):
    from nereus.cli import main

    bad = tmp_path / "run.sh"
    bad.write_text('python3 -m openrlhf.cli.train_ppo_ray --actor.model_name_or_path "abc \\\n')
    assert main(["plan", "--from-openrlhf", str(bad), "--model", "tiny"]) == 2
    err = capsys.readouterr().err
    assert f"--from-openrlhf '{bad}'" in err and "No closing quotation" in err and "unmatched" in err
    assert main(["plan", "--from-openrlhf", "--rollout.max_new_tokens 8 \\", "--model", "tiny"]) == 2
    err = capsys.readouterr().err
    assert "No escaped character" in err and "a backslash with nothing after it" in err


def test_model_path_notes_say_overridden_by_model():
    from nereus.integrations.common import model_override_notes

    notes = ["actor_rollout_ref.model.path='Qwen/X': not a key Nereus reads; ignored", "other: kept"]
    assert model_override_notes(notes, "/m/config.json") == [
        "actor_rollout_ref.model.path='Qwen/X': overridden by --model (shapes read from /m/config.json)", "other: kept"]
    assert model_override_notes(notes, None) == notes
