"""Validate the cost model's RL step and generation times against public verl measurements (issue 27).

Reads ``benchmarks/data/rl_measurements.csv`` (one row per window of steps of a public verl training
log, with the run's configuration and the measured ``timing_s/gen`` and ``timing_s/step``; sources
in ``benchmarks/data/RL_README.md``), predicts each row with :class:`nereus.cost.model.CostModel` and
prints predicted vs measured generation and step times:

* **uncalibrated**: the default efficiencies and the framework's engine preset
  (:data:`nereus.spec.engine.ENGINE_PRESETS`; ``--engine none`` shows the model without the engine
  terms);
* **calibrated on one plan per job**: one scale per op-class group fitted
  (:func:`nereus.cost.fit.fit_scales`, the prior towards the defaults) on the measured generation and
  step totals of the job's first window only, then every other window of the job predicted with the
  fitted table. Only classes the calibration window exercises are fitted. Reported on the held-out
  windows; the check "never worse than uncalibrated" is per job.

How a row becomes a cost-model query (verl's hybrid engine: every model-stage on all the job's GPUs,
one after another):

* workload: ``prompts_per_step`` prompts x ``n``, the window's median mean prompt and response
  lengths, ``response_len_max`` = the window's median longest response, mini-batch ``mini·n``
  sequences (verl's ``ppo_mini_batch_size`` counts prompts), ``memory_fraction`` = vLLM's
  ``gpu_memory_utilization``, a rule-based reward (no reward model);
* framework: ``fsdp`` (ZeRO-3 training and inference engines) with the engine preset, and
  ``pad_to = max_prompt_length + max_response_length`` where the run does not remove padding;
* candidates: ``actor.generate`` at the rollout TP, ``dp = GPUs/TP``, concurrency the KV-cache
  capacity (``memory_fraction`` of the GPU less the weights, over the mean sequence's KV bytes; at
  most vLLM's ``max_num_seqs`` = 1024); inference and training model-stages at ``dp = GPUs``,
  ZeRO-3, the run's micro-batches, full recompute where gradient checkpointing is on, the reference
  offloaded to host where ``ref.fsdp_config.param_offload`` is set;
* step: generation + the inference model-stages + the training model-stages (colocated: their
  times add) + the engine's fixed per-step cost. Where the log's generation timer also covers the
  old-log-prob forward (verl <= 0.1, the 0.5B logs), the measured generation is compared with
  ``actor.generate + actor.infer``.

Held-out generation rows (vLLM serving runs no constant was derived from,
:mod:`heldout_generation`) are predicted and reported separately, in the line before the last.

Run: ``python benchmarks/validate_rl_steps.py [--csv PATH] [--engine PRESET] [--json PATH]``; takes a
few seconds on a CPU. The last line reads ``RL step time: median APE X% uncalibrated, Y% calibrated
over N runs; generation Z%``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import heldout_generation as hg  # noqa: E402  (benchmarks/, next to this file)

from nereus.cost import engine_terms as et  # noqa: E402
from nereus.cost.efficiency import EfficiencyTable  # noqa: E402
from nereus.cost.fit import deadband_targets, fit_scales  # noqa: E402
from nereus.cost.model import CostModel  # noqa: E402
from nereus.cost.shapes import kv_bytes_per_token_rank  # noqa: E402
from nereus.spec.engine import get_engine  # noqa: E402
from nereus.spec.framework import get_framework  # noqa: E402
from nereus.spec.hardware import (  # noqa: E402
    ClusterSpec,  # noqa: E402
    GPUSpec,
    get_gpu,
)
from nereus.spec.job import JobSpec  # noqa: E402
from nereus.spec.model import ModelSpec  # noqa: E402
from nereus.spec.plan import Candidate  # noqa: E402
from nereus.spec.presets import get_model  # noqa: E402
from nereus.spec.workload import WorkloadSpec  # noqa: E402

CSV = ROOT / "benchmarks" / "data" / "rl_measurements.csv"
#: vLLM's default ``max_num_seqs`` in verl's rollout config (the 0.5B logs print 1024)
MAX_NUM_SEQS = 1024

#: deepseek-ai/deepseek-llm-7b-chat config.json (Llama architecture, MHA)
DEEPSEEK_7B = ModelSpec(name="deepseek-llm-7b-chat", hidden_size=4096, intermediate_size=11008, num_layers=30,
                        num_attention_heads=32, num_kv_heads=32, head_dim=128, vocab_size=102400,
                        rope_theta=10000.0, max_position_embeddings=4096, rms_norm_eps=1e-6)

#: AMD Instinct MI300X, one OAM (no preset in nereus.spec.hardware yet)
MI300X = GPUSpec(
    name="mi300x", peak_flops=1307.4e12, memory_bytes=192 * 1000**3, hbm_bandwidth=5.3e12,
    scaleup_bandwidth=448e9, scaleout_bandwidth=50e9, scaleup_link="xgmi", scaleout_link="ib",
    host_bandwidth=64e9, host_memory_bandwidth=76.8e9, peak_flops_fp8=2614.9e12,
    default_efficiency={"gemm": round(0.75 * 781.9 / 1307.4, 3)},
    source="AMD Instinct MI300X datasheet: 1,307.4 TFLOP/s dense bf16, 2,614.9 dense FP8, 192 GB HBM3, 5.3 TB/s, "
           "7 Infinity Fabric links of 64 GB/s per direction (448 per GPU), PCIe Gen5 x16; gemm default: "
           "GEMM_SHAPE_DERATE x the bf16 MAMF 781.9 TFLOP/s of ml-engineering's table; host DRAM as DGX H100")

_MODELS = {"deepseek-llm-7b-chat": DEEPSEEK_7B}
_GPUS = {"mi300x": MI300X}


def load_rows(path=CSV) -> list[dict]:
    """Rows of the CSV with numbers parsed (empty ``measured_step_s`` -> None)."""
    out = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            d = dict(r)
            for k in ("gpus", "prompts", "n", "prompt_cap", "resp_cap", "mini", "micro_train", "micro_critic",
                      "micro_infer", "rollout_tp", "remove_padding", "grad_ckpt", "ref_offload",
                      "gen_includes_old_logprob", "resp_max"):
                d[k] = int(float(d[k]))
            for k in ("mem_util", "prompt_mean", "resp_mean", "measured_gen_s"):
                d[k] = float(d[k])
            d["measured_step_s"] = float(d["measured_step_s"]) if d["measured_step_s"] else None
            out.append(d)
    return out


def job_of(row: dict, engine: str) -> JobSpec:
    """The cost-model job of one row (module docstring)."""
    model = _MODELS.get(row["model"]) or get_model(row["model"])
    gpu = _GPUS.get(row["gpu"]) or get_gpu(row["gpu"])
    n = row["n"]
    r = max(int(round(row["resp_mean"])), 1)
    w = WorkloadSpec(algorithm=row["algorithm"], prompts_per_step=row["prompts"], samples_per_prompt=n,
                     prompt_len=max(int(round(row["prompt_mean"])), 1), response_len=r,
                     response_len_max=max(row["resp_max"], r), mini_batch_size=row["mini"] * n,
                     micro_batch_size=row["micro_train"], infer_micro_batch_size=row["micro_infer"],
                     recompute="full" if row["grad_ckpt"] else "none", reward_model=False,
                     memory_fraction=row["mem_util"])
    eng = get_engine(engine)
    if engine == "verl-eager" and gpu.scaleup_link == "xgmi":
        eng = get_engine("verl-eager-rocm")  # vLLM's ROCm build on AMD GPUs
    if not row["remove_padding"] and eng.name != "none":
        eng = replace(eng, pad_to=row["prompt_cap"] + row["resp_cap"])
    fw = replace(get_framework("fsdp"), engine=None if eng.name == "none" else eng)
    return JobSpec(actor=model, cluster=ClusterSpec(gpu=gpu, num_nodes=1, gpus_per_node=row["gpus"]), workload=w,
                   framework=fw)


def candidates(row: dict, job: JobSpec) -> dict:
    """Model-stage -> Candidate of the run's layout."""
    g, tp = row["gpus"], row["rollout_tp"]
    w = job.workload
    kv = kv_bytes_per_token_rank(job.actor, w.kv_bytes, tp, 1)
    free = w.memory_fraction * job.cluster.gpu.memory_bytes - job.actor.num_params * w.param_bytes / tp
    conc = int(max(1, min(MAX_NUM_SEQS, free / (kv * (w.prompt_len + w.response_len)))))
    rc = "full" if row["grad_ckpt"] else "none"
    a = w.mini_batch_size // (g * row["micro_train"])
    out = {"actor.generate": Candidate("actor.generate", tp, 1, g // tp, concurrency=conc),
           "actor.infer": Candidate("actor.infer", 1, 1, g, micro_batch=row["micro_infer"], zero=3),
           "reference.infer": Candidate("reference.infer", 1, 1, g, micro_batch=row["micro_infer"], zero=3,
                                        offload="host" if row["ref_offload"] else "none"),
           "actor.train": Candidate("actor.train", 1, 1, g, micro_batch=row["micro_train"], grad_accum=a,
                                    recompute=rc, zero=3)}
    if row["algorithm"] == "ppo":
        mc = row["micro_critic"]
        out["critic.infer"] = Candidate("critic.infer", 1, 1, g, micro_batch=mc, zero=3)
        out["critic.train"] = Candidate("critic.train", 1, 1, g, micro_batch=mc,
                                        grad_accum=w.mini_batch_size // (g * mc), recompute=rc, zero=3)
    return out


def _merge(ds) -> dict:
    out: dict = {}
    for d in ds:
        for k, v in d.items():
            out[k] = out.get(k, 0.0) + v
    return out


def predict(row: dict, engine: str, eff: EfficiencyTable | None = None) -> dict:
    """Predicted generation and step seconds and their op-class breakdowns for one row."""
    job = job_of(row, engine)
    cm = CostModel(job, efficiency=eff)
    ests = {name: cm.estimate_candidate(c) for name, c in candidates(row, job).items()}
    gen_names = ["actor.generate"] + (["actor.infer"] if row["gen_includes_old_logprob"] else [])
    fixed = et.step_overhead(job.framework.engine, cm.eff, job.cluster.gpu)
    step_bd = _merge([e.breakdown for e in ests.values()])
    if fixed:
        step_bd["framework"] = step_bd.get("framework", 0.0) + fixed
    return {"gen": sum(ests[n].time for n in gen_names), "step": sum(e.time for e in ests.values()) + fixed,
            "gen_bd": _merge([ests[n].breakdown for n in gen_names]), "step_bd": step_bd,
            "stages": {k: round(v.time, 2) for k, v in ests.items()}, "gpu": job.cluster.gpu}


def ape(p: float, m: float) -> float:
    return abs(p - m) / m * 100.0


def _median(xs):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = len(xs) // 2
    return xs[k] if len(xs) % 2 else 0.5 * (xs[k - 1] + xs[k])


def calibrate(row: dict, pred: dict, engine: str) -> EfficiencyTable:
    """One scale per op-class group fitted on one row's measured generation and step totals, each
    moved onto the model's 10% noise band first (:func:`nereus.cost.fit.deadband_targets`)."""
    bds, meas = [pred["gen_bd"]], [row["measured_gen_s"]]
    if row["measured_step_s"]:
        bds.append(pred["step_bd"])
        meas.append(row["measured_step_s"])
    meas = deadband_targets([sum(bd.values()) for bd in bds], meas)
    fit = fit_scales(bds, meas, eff_bounds=(0.02, 1.5), gpu=pred["gpu"])
    return fit.table


def transfer(rows: list[dict], engine: str) -> dict:
    """Leave one job out: one fit on the calibration rows of the other jobs (their generation and
    step totals, as :func:`calibrate`), then the held-out job's rows predicted with it. Returns the
    median APE of step and generation over all rows so predicted."""
    jobs: dict = {}
    for r in rows:
        jobs.setdefault(r["job"], []).append(r)
    calib = {j: next((r for r in rs if r["measured_step_s"]), rs[0]) for j, rs in jobs.items()}
    step, gen = [], []
    for job, rs in jobs.items():
        bds, meas, gpu = [], [], None
        for other, c in calib.items():
            if other == job:
                continue
            p = predict(c, engine)
            gpu = p["gpu"]
            bds += [p["gen_bd"]] + ([p["step_bd"]] if c["measured_step_s"] else [])
            meas += [c["measured_gen_s"]] + ([c["measured_step_s"]] if c["measured_step_s"] else [])
        meas = deadband_targets([sum(bd.values()) for bd in bds], meas)
        table = fit_scales(bds, meas, eff_bounds=(0.02, 1.5), gpu=gpu).table
        for r in rs:
            p = predict(r, engine, table.copy())
            gen.append(ape(p["gen"], r["measured_gen_s"]))
            if r["measured_step_s"]:
                step.append(ape(p["step"], r["measured_step_s"]))
    return {"step": _median(step), "gen": _median(gen), "n_step": len(step), "n_gen": len(gen)}


def run(rows: list[dict], engine: str) -> dict:
    """Predictions, calibrated predictions and APE summaries over the rows."""
    jobs: dict = {}
    for r in rows:
        jobs.setdefault(r["job"], []).append(r)
    out = {"rows": [], "jobs": {}}
    for job, rs in jobs.items():
        calib_row = next((r for r in rs if r["measured_step_s"]), rs[0])
        p0 = predict(calib_row, engine)
        table = calibrate(calib_row, p0, engine)
        per_job = {"uncal_step": [], "cal_step": [], "uncal_gen": [], "cal_gen": [], "calibrated_on": calib_row["window"]}
        for r in rs:
            p = predict(r, engine)
            pc = predict(r, engine, table.copy())
            rec = {"job": job, "window": r["window"], "measured_gen": r["measured_gen_s"], "pred_gen": p["gen"],
                   "cal_gen": pc["gen"], "measured_step": r["measured_step_s"], "pred_step": p["step"],
                   "cal_step": pc["step"], "held_out": r is not calib_row, "stages": p["stages"]}
            out["rows"].append(rec)
            per_job["uncal_gen"].append(ape(p["gen"], r["measured_gen_s"]))
            if r is not calib_row:
                per_job["cal_gen"].append(ape(pc["gen"], r["measured_gen_s"]))
            if r["measured_step_s"]:
                per_job["uncal_step"].append(ape(p["step"], r["measured_step_s"]))
                if r is not calib_row:
                    per_job["cal_step"].append(ape(pc["step"], r["measured_step_s"]))
        out["jobs"][job] = per_job
    return out


def summarize(res: dict) -> dict:
    allj = res["jobs"].values()
    steps = [x for j in allj for x in j["uncal_step"]]
    cal_steps = [x for j in allj for x in j["cal_step"]]
    gens = [x for j in allj for x in j["uncal_gen"]]
    cal_gens = [x for j in allj for x in j["cal_gen"]]
    worse, per_job = [], {}
    for name in res["jobs"]:
        held = [r for r in res["rows"] if r["job"] == name and r["held_out"]]
        u = [ape(r["pred_step"], r["measured_step"]) for r in held if r["measured_step"]] + \
            [ape(r["pred_gen"], r["measured_gen"]) for r in held]
        c = [ape(r["cal_step"], r["measured_step"]) for r in held if r["measured_step"]] + \
            [ape(r["cal_gen"], r["measured_gen"]) for r in held]
        per_job[name] = (_median(u), _median(c), len(u))
        if u and _median(c) > _median(u):
            worse.append(name)
    return {"step_uncal": _median(steps), "step_cal": _median(cal_steps), "gen_uncal": _median(gens),
            "gen_cal": _median(cal_gens), "n_step": len(steps), "n_gen": len(gens), "n_step_cal": len(cal_steps),
            "jobs_worse_after_calibration": worse, "per_job_held_out": per_job}


def heldout_summary(rows=None) -> dict:
    """Median APE of the held-out generation rows (:mod:`heldout_generation`) with the kernel terms
    only and, for reference, with the eager presets' per-step overhead; plus the per-row results."""
    rows = hg.load_heldout() if rows is None else rows
    k, e = hg.run(rows, hg.KERNELS_ONLY), hg.run(rows, hg.EAGER_STEP)
    return {"kernels": _median([abs(x["err"]) * 100 for x in k]), "eager_step": _median([abs(x["err"]) * 100 for x in e]),
            "n": len(rows), "rows": k}


def print_heldout() -> None:
    h = heldout_summary()
    print("held-out generation rows (vLLM serving, benchmarks/data/vllm_generation_heldout.csv; no constant derived "
          "from them):")
    for x in h["rows"]:
        print(f"  {x['job']:26s} {x['prompts']:4d} prompts  measured {x['measured']:6.2f} s  predicted "
              f"{x['pred']:6.2f} s  ({x['err'] * 100:+.1f}%)")
    print(f"held-out generation: median APE {h['kernels']:.1f}% over {h['n']} vLLM rows (kernel terms, batch ends "
          f"with its longest response; no engine preset fits CUDA-graph vLLM); {h['eager_step']:.1f}% with the eager "
          f"presets' per-step overhead (wrong mode, reference)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--csv", default=str(CSV))
    ap.add_argument("--engine", default="verl-eager", help="engine preset (nereus.spec.engine.ENGINE_PRESETS)")
    ap.add_argument("--json", default=None, help="write the per-row results here")
    args = ap.parse_args(argv)
    res = run(load_rows(args.csv), args.engine)
    print(f"{'job':26s} {'win':5s} {'gen meas':>8s} {'pred':>7s} {'cal':>7s}   {'step meas':>9s} {'pred':>7s} {'cal':>7s}")
    for r in res["rows"]:
        ms = f"{r['measured_step']:9.1f}" if r["measured_step"] else f"{'-':>9s}"
        print(f"{r['job']:26s} {r['window']:5s} {r['measured_gen']:8.1f} {r['pred_gen']:7.1f} {r['cal_gen']:7.1f}   "
              f"{ms} {r['pred_step']:7.1f} {r['cal_step']:7.1f}{'' if r['held_out'] else '  (calibration row)'}")
    s = summarize(res)
    print(f"generation: median APE {s['gen_uncal']:.1f}% uncalibrated over {s['n_gen']} rows, "
          f"{s['gen_cal']:.1f}% calibrated (held-out rows)")
    for name, (u, c, n) in s["per_job_held_out"].items():
        print(f"  {name:26s} held-out median APE (step and generation, {n} values): {u:5.1f}% uncalibrated, "
              f"{c:5.1f}% calibrated")
    print(f"jobs whose held-out error grows after calibration: {s['jobs_worse_after_calibration'] or 'none'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": s, "rows": res["rows"]}, indent=1, default=str))
    t = transfer(load_rows(args.csv), args.engine)
    print(f"calibrated on the other jobs (leave one job out): step median APE {t['step']:.1f}% over "
          f"{t['n_step']} rows, generation {t['gen']:.1f}% over {t['n_gen']}")
    print(f"calibrated step figure over the {s['n_step_cal']} held-out rows with a measured step time "
          f"(the calibration rows excluded)")
    print_heldout()
    cal = s["step_cal"]
    cal_txt = f"{cal:.1f}%" if not math.isnan(cal) else "n/a"
    print(f"RL step time: median APE {s['step_uncal']:.1f}% uncalibrated, {cal_txt} calibrated over "
          f"{s['n_step']} runs; generation {s['gen_uncal']:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
