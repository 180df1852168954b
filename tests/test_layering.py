"""Layering: the plan data types sit below the cost model and the planner (issue 13, item 9)."""

import ast
from pathlib import Path

import nereus.planner.plan as planner_plan
import nereus.spec.plan as spec_plan

ROOT = Path(__file__).resolve().parent.parent / "nereus"


def _imports(path: Path) -> set[str]:
    mods = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            mods.add(node.module)
        elif isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
    return mods


def test_cost_and_spec_do_not_import_the_planner():
    for pkg in ("cost", "spec"):
        for f in sorted((ROOT / pkg).glob("*.py")):
            bad = sorted(m for m in _imports(f) if m.startswith("nereus.planner"))
            assert not bad, f"nereus/{pkg}/{f.name} imports {bad}"


def test_planner_plan_re_exports_the_same_types():
    for name in ("Candidate", "Plan", "StageEstimate", "load_plan", "read_plan_document"):
        assert getattr(planner_plan, name) is getattr(spec_plan, name)
