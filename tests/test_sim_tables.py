"""scripts/simulate_tables.py: the across-traces tables of docs/simulate.md, on hand-made runs."""

import importlib.util
import math
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("simulate_tables", ROOT / "scripts" / "simulate_tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(trace, seed, policy, thr, restarts=0, causes=None, transitions=0, seconds=0.0):
    return {"trace": trace, "seed": seed, "notice": 0.0, "policy": policy, "tokens_per_s": thr,
            "restarts": restarts, "restart_causes": causes or {}, "transitions": transitions,
            "transition_s": seconds}


def test_tables_by_hand():
    runs = [
        _run("a", 0, "nereus", 200.0, 1, {"state_lost": 1}, 3, 30.0), _run("a", 0, "uncalibrated", 100.0),
        _run("a", 1, "nereus", 100.0, 0, None, 2, 20.0), _run("a", 1, "uncalibrated", 200.0, 2, {"no_plan": 2}),
        _run("b", 0, "nereus", 100.0), _run("b", 0, "uncalibrated", 100.05),
        _run("b", 1, "nereus", 300.0), _run("b", 1, "uncalibrated", 100.0),
    ]
    md = _module().tables(runs)
    # ratios 2, 0.5, 0.9995 (a tie: within 0.1%), 3: geometric mean (2 * 0.5 * 0.9995 * 3) ** (1/4)
    geo = (2 * 0.5 * (100 / 100.05) * 3) ** 0.25
    assert f"| none | {geo:.3f} (0.50–3.00); 2 / 1 / 1 |" in md
    assert "| none | 1 / 2 | 5 (50) / - / 0 (0) |" in md            # restarts; transitions n (s)
    # per trace: a = sqrt(2 * 0.5) = 1.00, b = sqrt(0.9995 * 3) = 1.73
    assert "| a | 1.00 |" in md and f"| b | {math.sqrt(100 / 100.05 * 3):.2f} |" in md
    assert "| none | state_lost 1 | no_plan 2 |" in md


def test_tables_per_job_class_by_hand():
    def run(job, trace, policy, thr):
        return _run(trace, 0, policy, thr) | {"job": job}
    runs = [run("70b-ppo", "a", "nereus", 300.0), run("70b-ppo", "a", "static", 100.0),
            run("70b-ppo", "b", "nereus", 90.0), run("70b-ppo", "b", "static", 100.0),
            run("qwen3-32b-grpo", "a", "nereus", 50.0), run("qwen3-32b-grpo", "a", "static", 50.0),
            run("qwen3-32b-grpo", "b", "nereus", 0.0), run("qwen3-32b-grpo", "b", "static", 0.0),
            _run("a", 0, "nereus", 120.0), _run("a", 0, "static", 100.0)]  # no job field: the 8b class
    md = _module().tables(runs)
    # 70b-ppo: ratios 3.0 and 0.9, geometric mean sqrt(2.7); one run below 0.98x static (0.900)
    assert f"| 70b-ppo | none | 2 | 0 | {math.sqrt(2.7):.3f} | 0.900 | 1 |" in md
    assert "| qwen3-32b-grpo | none | 1 | 1 | 1.000 | 1.000 | 0 |" in md  # trace b made no tokens
    assert "| 8b | none | 1 | 0 | 1.200 | 1.200 | 0 |" in md
    # over all classes: 3.0, 0.9, 1.0, 1.2
    assert f"| all | none | 4 | 1 | {(3.0 * 0.9 * 1.0 * 1.2) ** 0.25:.3f} | 0.900 | 1 |" in md
    # the per-job tables keep the classes apart: trace a is 3.00 for 70b-ppo and 1.00 for qwen3
    body70 = md.split("**70b-ppo**")[1].split("**qwen3-32b-grpo**")[0]
    assert "| a | 3.00 |" in body70 and "| b | 0.90 |" in body70
    assert "| a | 1.00 |" in md.split("**qwen3-32b-grpo**")[1].split("**8b**")[0]


def test_bench_admission_summary_by_hand():
    spec = importlib.util.spec_from_file_location("bench_admission", ROOT / "benchmarks" / "bench_admission.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    # two runs of one job class: nereus 200 / 100, static 100 / 125, replan-all 100 / 100
    res = {("8b", "a", 0, 0.0, "nereus"): 200.0, ("8b", "a", 0, 0.0, "static"): 100.0,
           ("8b", "a", 0, 0.0, "replan-all"): 100.0,
           ("8b", "b", 0, 0.0, "nereus"): 100.0, ("8b", "b", 0, 0.0, "static"): 125.0,
           ("8b", "b", 0, 0.0, "replan-all"): 100.0}
    keys = [("8b", "a", 0, 0.0), ("8b", "b", 0, 0.0)]
    s = mod.summarize(res, keys, ["nereus", "static", "replan-all"])
    st = s[("8b", 0.0, "static")]
    assert math.isclose(st["geo_mean"], math.sqrt(2.0 * 0.8)) and (st["wins"], st["losses"]) == (1, 1)
    nr = s[("8b", 0.0, "nereus")]
    # nereus / static = 2.0 and 0.8: it loses once to static, and that run is below 0.98x
    assert nr["loses_to_static"] == 1 and nr["below_0.98_static"] == 1 and math.isclose(nr["vs_static_min"], 0.8)
    rp = s[("all", "all", "replan-all")]
    assert math.isclose(rp["geo_mean"], math.sqrt(2.0)) and rp["ties"] == 1 and rp["loses_to_static"] == 1


def test_bench_admission_takes_the_plan_space_from_the_job_class():
    spec = importlib.util.spec_from_file_location("bench_admission", ROOT / "benchmarks" / "bench_admission.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.scenario("70b-ppo", "bamboo-p3", 0, 1.0, 0.0, "x.csv").framework == "megatron"
    assert mod.scenario("8b", "bamboo-p3", 0, 1.0, 0.0, "x.csv").framework == "nereus"
    assert mod.scenario("70b-ppo", "bamboo-p3", 0, 1.0, 0.0, "x.csv", "nereus").framework == "nereus"
    jobs = ["8b", "70b-ppo"]
    assert mod.parse_frameworks(None, jobs) == {}
    assert mod.parse_frameworks("megatron", jobs) == {"8b": "megatron", "70b-ppo": "megatron"}
    assert mod.parse_frameworks("70b-ppo=nereus", jobs) == {"70b-ppo": "nereus"}
    import pytest
    with pytest.raises(ValueError, match="unknown framework 'nope'"):
        mod.parse_frameworks("nope", jobs)
    with pytest.raises(ValueError, match="unknown job class '1b'"):
        mod.parse_frameworks("1b=megatron", jobs)
