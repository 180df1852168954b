"""Fits/OOM verdicts on users' RL layouts (issue 28): each row of ``benchmarks/data/user_layouts.csv``
(a published working layout or a public OOM report, with its source) is imported as the user wrote
it (verl overrides or an OpenRLHF command line), evaluated by the cost model at the lengths the row
gives and with the memory rule of
the vLLM version the row's framework version ran (the importers choose it from the
``framework_version`` column, :mod:`nereus.integrations.framework_versions`; a row without a known
version names it in ``vllm_rule``, its source in ``vllm_source``; :mod:`nereus.cost.vllm_startup`),
and the verdict (fits / OOM / refused by name)
compared with the published outcome (``fits``, ``oom``, or ``refused`` where the framework's own code
refuses the layout as recorded, the row's note citing where). Prints one line per row (the peak per-GPU bytes of the device's,
and the plan check's margin: its 10% headroom applies to the predicted bytes, not to vLLM's own
pre-allocation) and the score, twice: at the rows' lengths, and at the launch lines' maxima for every
row whose lengths are not from its own log (a sensitivity check).

Lengths (``prompt_len``, ``response_len``, ``lengths_source``): a row with a training log of its own
takes the log's means (the maximum over steps of the per-step mean prompt and response lengths,
``lengths_source`` "training log ..."); a row with none that trains on GSM8K alone with packed
sequences (verl's ``use_remove_padding`` or ``use_dynamic_bsz``: activations and logits scale with the
micro-batch's real tokens, the sum of its lengths, not with its count times the maxima) takes GSM8K's
lengths from the published verl log with the longest means on those prompts (Qwen2.5-0.5B PPO,
prompt 109 / response 330; ``lengths_source`` "GSM8K lengths from ..."), capped at its launch line's
maxima; any other row is judged at its launch line's maxima (padded batches pad to the longest
sequence, and another dataset's lengths are not known). The rule is checked over the CSV by
``tests/test_user_layouts.py``.

    python benchmarks/user_layouts.py [--csv FILE]
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from nereus.cost.model import CostModel  # noqa: E402
from nereus.cost.step import engine_owned  # noqa: E402
from nereus.cost.vllm_startup import gpu_excess  # noqa: E402
from nereus.integrations.framework_versions import vllm_pin  # noqa: E402
from nereus.integrations.openrlhf import import_openrlhf  # noqa: E402
from nereus.integrations.verl import import_verl  # noqa: E402
from nereus.integrations.verl_config import load_verl_config  # noqa: E402
from nereus.planner.whatif import evaluate_layout  # noqa: E402
from nereus.spec.presets import MODEL_PRESETS  # noqa: E402

MODELS = json.loads((HERE / "data" / "user_layout_models.json").read_text())
#: GPUs of the reports with no Nereus preset (custom GPUs, get_gpu's JSON fields)
GPUS = json.loads((HERE / "data" / "user_layout_gpus.json").read_text())
#: GPUs per node of the reports whose launch line leaves the count to the machine (OpenRLHF train_ppo)
MACHINES = json.loads((HERE / "data" / "user_layout_machines.json").read_text())


def _model(name: str, tmp: Path) -> str:
    if name in MODEL_PRESETS:
        return name
    d = tmp / name
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(MODELS[name]))
    return str(d)


def _gpu(name: str) -> str:
    return json.dumps(GPUS[name]) if name in GPUS else name


def imported(row: dict, tmp: Path):
    """The row's import, at its framework version (``framework_version``; empty: the installed one)."""
    model, gpu = _model(row["model"], tmp), _gpu(row["gpu"])
    version = row.get("framework_version") or None
    if row["framework"] == "verl":
        return import_verl(load_verl_config(row["config"], json.loads(row["launch"])), model=model, gpu=gpu,
                           version=version)
    gpn = MACHINES.get(row["id"], {}).get("gpus_per_node")
    return import_openrlhf(row["launch"], model=model, gpu=gpu, version=version, gpus_per_node=gpn)


#: ``lengths_source`` prefix of a row whose lengths come from its own training log
OWN_LOG = "training log "


def verdict(row: dict, tmp: Path, at_maxima: bool = False) -> tuple[str, str]:
    """``(fits | oom | refused, detail)`` of one row; ``at_maxima``: at the launch line's maximum
    lengths unless the row's lengths are from its own log."""
    try:
        imp = imported(row, tmp)
    except ValueError as e:  # a value Nereus refuses, named (the field, the value and what is valid)
        return "refused", str(e)[:160]
    if not imp.expressible:
        return "refused", "; ".join(str(u) for u in imp.unexpressible)[:160]
    w = imp.job.workload
    own = row["lengths_source"].startswith(OWN_LOG)
    lens = {k: int(row[k]) for k in ("prompt_len", "response_len") if row[k] and (own or not at_maxima)}
    # the importer chose the rule from the row's framework version; where the version's vLLM has no
    # sourced rule (or the version is not known) the row names it by hand
    pin = vllm_pin(row["framework"], row["framework_version"]) if row.get("framework_version") else None
    by_hand = row.get("vllm_rule") and (pin is None or pin.rule is None)
    rule = {"vllm_memory_rule": row["vllm_rule"]} if by_hand else {}
    job = imp.job.with_workload(replace(w, **lens, **rule)) if lens or rule else imp.job
    cost = CostModel(job)
    ev = evaluate_layout(job, imp.layout, cost=cost)
    peak = max(ev.plan.gpu_memory.values())
    over = max(gpu_excess(job, ev.plan, cost.headroom, cost.workspace, engine_owned(ev.plan, job.framework)).values())
    margin = f"{over / 2**30:.1f} GiB over" if over > 0 else f"{-over / 2**30:.1f} GiB to spare"
    return ("fits" if ev.fits else "oom"), (f"peak {peak / 2**30:.1f} GiB of {job.cluster.gpu.memory_bytes / 2**30:.1f}, "
                                            f"{margin}")


def score(path: Path, at_maxima: bool = False) -> tuple[int, int, list]:
    """``(right, rows, [(id, published, verdict, detail, source)])`` over the CSV at ``path``."""
    rows = list(csv.DictReader(path.open()))
    out = []
    with tempfile.TemporaryDirectory() as t:
        for r in rows:
            v, detail = verdict(r, Path(t), at_maxima)
            out.append((r["id"], r["outcome"], v, detail, r["source"]))
    right = sum(1 for _, want, got, _, _ in out if want == got)
    return right, len(out), out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--csv", default=str(HERE / "data" / "user_layouts.csv"))
    a = p.parse_args(argv)
    right, n, out = score(Path(a.csv))
    for i, want, got, detail, src in out:
        print(f"{i:>3} {'ok ' if want == got else 'MISS'} published {want:<5} Nereus {got:<7} {detail}  [{src}]")
    m_right, _, m_out = score(Path(a.csv), at_maxima=True)
    flips = [i for (i, _, got, _, _), (_, _, got_m, _, _) in zip(out, m_out) if got != got_m]
    print(f"at the launch lines' maxima (rows without their own log): right on {m_right} of {n} "
          f"({100 * m_right / n:.1f}%); verdicts that change: {', '.join(flips) or 'none'}")
    print(f"fits/OOM right on {right} of {n} layouts ({100 * right / n:.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
