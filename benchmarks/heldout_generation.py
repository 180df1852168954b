"""Held-out generation rows for ``validate_rl_steps.py`` (issue 27 item 4): vLLM serving measurements
that no constant of the cost model was derived from.

Data: ``benchmarks/data/vllm_generation_heldout.csv`` (sources and caveats in
``benchmarks/data/RL_README.md``, section "Held-out generation rows"): Lambda's published vLLM
benchmark (``LambdaLabsML/vllm-benchmark``, the raw ``benchmark_serving.py`` result files of its
report ``benchmark_v0.md``), Meta-Llama-3-8B-Instruct in bf16 on one H100-80GB-SXM and one
A100-80GB-SXM, 10 / 40 / 160 ShareGPT prompts sent at once (request rate ``inf``). Each file lists
every request's prompt and generated length, so the batch's token counts and its longest response
are known exactly; the measured figure is the benchmark's ``duration`` (first request sent to last
response received).

A row becomes one ``actor.generate`` estimate (:meth:`nereus.cost.model.CostModel.estimate_candidate`)
of a one-GPU job: ``prompts`` sequences, the row's mean prompt and response lengths,
``response_len_max`` = the longest response, concurrency = all requests (below vLLM's
``max_num_seqs`` and the KV blocks that fit in ``gpu_memory_utilization`` 0.95), the engine's
``generation="longest"`` mode (the batch ends with its longest response, continuous batching:
:func:`nereus.cost.engine_terms.decode_steps`). A stand-alone server receives no weights, so the
actor's weight-sync receive (:func:`nereus.cost.latency.weight_sync_times`, ``side="recv"``) is
taken out of the estimate.

Engine preset: none of :data:`nereus.spec.engine.ENGINE_PRESETS` fits. These runs use vLLM's
default CUDA graphs (and, from the 10-token chunks of their streamed output, multi-step scheduling
with 10 steps), while ``verl-eager``/``verl-eager-rocm`` describe eager mode inside verl (their 12.5 s
``generate_call_s`` is verl's engine wake and weight load, absent here). So the figure is taken with
:data:`KERNELS_ONLY` (every overhead 0: the kernel terms and the longest-response decode steps, no
fitted constant) and, for reference only, with the eager presets' ``decode_step_s`` (:data:`EAGER_STEP`),
which is the wrong mode for these runs.
"""

from __future__ import annotations

import csv
from dataclasses import replace
from pathlib import Path

from nereus.cost import latency as lat
from nereus.cost.model import CostModel
from nereus.spec.engine import EngineCosts, get_engine
from nereus.spec.framework import get_framework
from nereus.spec.hardware import ClusterSpec, get_gpu
from nereus.spec.job import JobSpec
from nereus.spec.plan import Candidate
from nereus.spec.presets import get_model
from nereus.spec.workload import WorkloadSpec

CSV = Path(__file__).resolve().parent / "data" / "vllm_generation_heldout.csv"
#: the kernel terms only, the batch ending with its longest response; no overhead constant
KERNELS_ONLY = EngineCosts(name="kernels-longest", generation="longest")
#: as KERNELS_ONLY plus the eager presets' per-decode-step overhead (eager mode: not these runs' mode)
EAGER_STEP = replace(KERNELS_ONLY, name="eager-step", decode_step_s=get_engine("verl-eager").decode_step_s)

_INT = ("gpus", "tp", "prompts", "prompt_tokens", "output_tokens", "resp_max", "concurrency")


def load_heldout(path=CSV) -> list[dict]:
    """Rows of the held-out CSV with numbers parsed.

    Raises:
        ValueError: a row whose longest response is below its mean, or whose concurrency is below 1.
    """
    out = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            d = dict(r)
            for k in _INT:
                d[k] = int(d[k])
            d["mem_util"], d["measured_s"] = float(d["mem_util"]), float(d["measured_s"])
            if d["resp_max"] * d["prompts"] < d["output_tokens"] or d["concurrency"] < 1:
                raise ValueError(f"held-out row {d['job']}/{d['prompts']}: resp_max={d['resp_max']} below the mean "
                                 f"response or concurrency={d['concurrency']} < 1")
            out.append(d)
    return out


def job_of(row: dict, engine: EngineCosts = KERNELS_ONLY) -> JobSpec:
    """The one-engine job of a row (module docstring); lengths are the row's means, rounded."""
    n = row["prompts"]
    r = max(round(row["output_tokens"] / n), 1)
    w = WorkloadSpec(algorithm="ppo", prompts_per_step=n, samples_per_prompt=1,
                     prompt_len=max(round(row["prompt_tokens"] / n), 1), response_len=r,
                     response_len_max=max(row["resp_max"], r), mini_batch_size=n, micro_batch_size=1,
                     reward_model=False, rollout_memory_fraction=row["mem_util"])
    fw = replace(get_framework("fsdp"), engine=engine)
    return JobSpec(actor=get_model(row["model"]), cluster=ClusterSpec(gpu=get_gpu(row["gpu"]), num_nodes=1,
                   gpus_per_node=row["gpus"]), workload=w, framework=fw)


def predict(row: dict, engine: EngineCosts = KERNELS_ONLY) -> dict:
    """Predicted generation seconds of a row and its op-class breakdown, without the weight sync."""
    job = job_of(row, engine)
    cm = CostModel(job)
    tp = row["tp"]
    est = cm.estimate_candidate(Candidate("actor.generate", tp, 1, row["gpus"] // tp, concurrency=row["concurrency"]))
    bd = {k: float(v) for k, v in est.breakdown.items()}
    sync = lat.weight_sync_times(job.actor, job.workload, job.cluster, cm.eff, tp, 1, "recv", False)
    for k, v in sync.items():
        bd[k] = bd.get(k, 0.0) - float(v)
        if abs(bd[k]) < 1e-12:
            del bd[k]
    return {"gen": sum(bd.values()), "bd": bd}


def run(rows: list[dict], engine: EngineCosts = KERNELS_ONLY) -> list[dict]:
    """Per row: measured and predicted seconds and the signed error (predicted / measured - 1)."""
    out = []
    for r in rows:
        p = predict(r, engine)
        out.append({"job": r["job"], "prompts": r["prompts"], "measured": r["measured_s"], "pred": p["gen"],
                    "err": p["gen"] / r["measured_s"] - 1.0, "bd": p["bd"]})
    return out
