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
