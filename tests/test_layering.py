"""The import graph of the package: no circles, no import up the layers, worker code never imports
driver code (issue 23; DESIGN.md §3).

Every ``import`` / ``from ... import`` of a ``nereus`` module anywhere in a module counts (also the
ones inside functions: a lazy import still couples the two modules), read from the source with
``ast``, so the test needs none of the optional dependencies.
"""

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent / "nereus"

#: top-level packages from the bottom up; a package may import only packages before it. The order is
#: DESIGN.md §3's picture (spec -> cost -> planner -> controller -> transition -> runtime) with two
#: refinements the code needs: transition planning sits below the controller (the controller prices a
#: move with the transition planner's ``L_tran``), and the integrations sit beside the planner (they
#: turn a framework's configuration into a job and a layout and evaluate it with the planner).
LAYERS = ["spec", "workflow", "cost", "planner", "integrations", "transition", "controller", "sim",
          "runtime", "cli"]

#: runtime subpackages whose modules run inside a worker process (or are pure helpers both sides use)
#: and the modules of the mixed subpackages that do; everything else under nereus/runtime runs in the
#: driver. Worker-side code never imports driver-side code.
WORKER_SIDE = ("nereus.runtime.comm", "nereus.runtime.model", "nereus.runtime.worker", "nereus.runtime.rl",
               "nereus.runtime.transit.plans", "nereus.runtime.transit.worker_side",
               "nereus.runtime.transit.index", "nereus.runtime.transit.packing",
               "nereus.runtime.transit.flat", "nereus.runtime.transit.regroup",
               "nereus.runtime.transit.residency", "nereus.runtime.transit.fault_probe", "nereus.runtime.transit.buffer_pool",
               "nereus.runtime.durable.worker_side", "nereus.runtime.durable.worker_calls")
DRIVER_SIDE = ("nereus.runtime.run", "nereus.runtime.transit.driver_side", "nereus.runtime.transit.sharded", "nereus.runtime.durable.driver_side",
               "nereus.runtime.durable.scheduling", "nereus.runtime.durable.integrity", "nereus.runtime.durable.store")


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph(root: Path = ROOT) -> nx.DiGraph:
    modules = {_module_name(p, root): p for p in root.rglob("*.py")}
    g = nx.DiGraph()
    g.add_nodes_from(modules)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for t in targets:
                if t in modules and t != name:
                    g.add_edge(name, t)
    return g


def _side(module: str) -> str | None:
    def under(prefixes):
        return any(module == p or module.startswith(p + ".") for p in prefixes)
    return "worker" if under(WORKER_SIDE) else "driver" if under(DRIVER_SIDE) else None


def _is_package(module: str) -> bool:
    return (ROOT.parent / module.replace(".", "/") / "__init__.py").exists()


def test_no_import_cycles():
    g = _graph()
    cycles = list(nx.simple_cycles(g))
    assert not cycles, f"import cycles: {cycles[:5]}"


def test_no_import_runs_up_the_layers():
    bad = []
    for a, b in _graph().edges:
        la, lb = a.split(".")[1], b.split(".")[1]
        if la in LAYERS and lb in LAYERS and LAYERS.index(lb) > LAYERS.index(a.split(".")[1]):
            bad.append(f"{a} -> {b}")
    assert not bad, "imports up the layers: " + "; ".join(bad)


def test_every_top_level_package_has_a_layer():
    tops = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()} | {
        p.stem for p in ROOT.glob("*.py") if p.stem != "__init__"}
    assert tops - {"data"} <= set(LAYERS), f"packages without a layer: {sorted(tops - set(LAYERS))}"


def test_worker_code_never_imports_driver_code():
    bad = [f"{a} -> {b}" for a, b in _graph().edges if _side(a) == "worker" and _side(b) == "driver"]
    assert not bad, "worker-side modules importing driver-side ones: " + "; ".join(bad)


def test_every_runtime_module_has_a_side():
    mods = [m for m in _graph().nodes if m.startswith("nereus.runtime.") and not _is_package(m)]
    assert mods and all(_side(m) for m in mods), [m for m in mods if not _side(m)]


def test_no_module_over_450_lines():
    long = {str(p.relative_to(ROOT.parent)): n for p in ROOT.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 450}
    assert not long, f"modules over 450 lines: {long}"


def test_the_checks_see_a_planted_cycle_and_an_upward_import(tmp_path):
    """The graph reader itself: a tree with a -> b -> a and spec -> runtime fails both checks."""
    pkg = tmp_path / "nereus"
    for sub in ("spec", "runtime"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "spec" / "a.py").write_text("from nereus.runtime.b import x\n")
    (pkg / "runtime" / "b.py").write_text("def f():\n    import nereus.spec.a\nx = 1\n")
    g = _graph(pkg)
    assert sorted(map(sorted, nx.simple_cycles(g))) == [["nereus.runtime.b", "nereus.spec.a"]]
    up = [(a, b) for a, b in g.edges if LAYERS.index(b.split(".")[1]) > LAYERS.index(a.split(".")[1])]
    assert up == [("nereus.spec.a", "nereus.runtime.b")]
