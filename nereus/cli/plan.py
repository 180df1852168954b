"""nereus plan: the fastest feasible plan for an RL job on a GPU pool.

Prints, per model-stage, tp/pp/dp, the micro-batch (or generation concurrency), the GPUs, the predicted
time and peak memory per GPU; then L_step and throughput (response tokens per second). ``--json``
prints the same as data (the input of ``nereus transition``), ``--breakdown`` adds memory terms and
time per op class, ``--frontier`` each model-stage's latency-vs-GPUs frontier. When nothing fits it
says how far the closest candidate is from fitting and exits with status 1.
"""

from __future__ import annotations

import argparse
import json
import sys

from nereus.cli.plan_output import print_layout_eval, print_plan
from nereus.cost.model import CostModel
from nereus.planner.candidates import latency_frontier
from nereus.planner.notation import format_candidate
from nereus.planner.search import NoFeasiblePlan, plan_job, search
from nereus.spec.framework import DEFAULT_FRAMEWORK, FRAMEWORK_PRESETS, get_framework
from nereus.spec.hardware import ClusterSpec, get_gpu
from nereus.spec.job import JobSpec, check_context
from nereus.spec.plan import Candidate
from nereus.spec.presets import get_model
from nereus.spec.workload import ALGORITHMS, RECOMPUTE_MODES, WorkloadSpec

GIB = 1024**3


def add_job_arguments(p: argparse.ArgumentParser) -> None:
    """Options that describe a job (shared by plan, simulate and transition)."""
    g = p.add_argument_group("job")
    g.add_argument("--job", metavar="FILE", help="job spec (.json/.yaml with model, cluster, workload; format in "
                   "docs/files.md), or the output of `nereus plan --json`; other job options override it")
    g.add_argument("--model", default=None, help="model preset (llama-3.1-8b, llama-3.3-70b, qwen3-14b, "
                   "qwen3-32b, qwen2.5-0.5b, tiny, small), a Hugging Face config.json path or a directory holding one [llama-3.1-8b]")
    g.add_argument("--algo", choices=ALGORITHMS, default=None, help="RL algorithm [ppo]")
    g.add_argument("--gpu", default=None, help="GPU preset (h100, h200, a100, a100-40gb, a800, h800, h20, l20, l40s, "
                   "h100-pcie, h100-nvl, mi300x, b200, mi250x, cpu: one CPU worker of `nereus run`), or a custom GPU: "
                   "a JSON file or inline JSON object of GPU fields (docs/files.md) [h100]")
    g.add_argument("--nodes", type=int, default=None, help="nodes in the cluster [2]")
    g.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node [8]")
    g.add_argument("--prompt-len", type=int, default=None, help="prompt tokens [1024]")
    g.add_argument("--response-len", type=int, default=None, help="response tokens (mean; time uses it) [2048]")
    g.add_argument("--response-len-max", type=int, default=None, help="response tokens memory is sized for "
                   "(the longest a micro-batch or KV cache holds; >= --response-len) [the mean]")
    g.add_argument("--response-lens", metavar="FILE", default=None, help="per-sample response lengths (one "
                   "integer per line, or a CSV with a response_length column): the mean sets --response-len "
                   "(unless given), the --response-len-percentile sets --response-len-max")
    g.add_argument("--response-len-percentile", type=float, default=None, metavar="P",
                   help="percentile (0-100] of --response-lens that memory is sized for [100: the maximum]")
    g.add_argument("--memory-fraction", type=float, default=None, help="share of each GPU's memory a plan may "
                   "use, in (0, 1] (vLLM's gpu_memory_utilization) [0.9: 10%% headroom]")
    g.add_argument("--lora-rank", type=int, default=None, help="LoRA adapter rank (frozen base weights) [none]")
    g.add_argument("--prompts-per-step", type=int, default=None, help="prompts per RL step [256]")
    g.add_argument("--samples-per-prompt", type=int, default=None, help="responses per prompt [4]")
    g.add_argument("--mini-batch", type=int, default=None, help="sequences per optimizer update [256]")
    g.add_argument("--micro-batch", type=int, default=None, help="largest training micro-batch [4]")
    g.add_argument("--ppo-epochs", type=int, default=None, help="passes over the batch per step [1]")
    g.add_argument("--recompute", choices=RECOMPUTE_MODES, default=None,
                   help="activation recomputation for training [auto]")
    g.add_argument("--no-reward-model", action="store_true", help="rule-based reward, no reward.infer")
    g.add_argument("--framework", default=None, choices=sorted(FRAMEWORK_PRESETS),
                   help="what your training framework supports, which sets the plan space: runtime (what `nereus "
                   "run` executes and transitions: ZeRO-1, offload, colocation), nereus (the paper's: disjoint "
                   "TP/PP/DP), megatron (distributed optimizer, sequence "
                   "parallel, interleaving, offload, colocation), fsdp (verl FSDP: ZeRO-2/3, offload, colocation, "
                   "no TP/PP training), deepspeed (OpenRLHF: ZeRO 0-3, Adam offload, colocation), generic (all); "
                   f"docs/planner.md [the job file's, else {DEFAULT_FRAMEWORK}]")
    g.add_argument("--async", dest="asynchronous", action="store_true",
                   help="one-step-off asynchronous RL (generation overlaps training)")


def job_from_args(args) -> JobSpec:
    """Build the :class:`JobSpec` from parsed options.

    Raises:
        ValueError: unknown preset, bad count or a malformed job/config file.
    """
    base = JobSpec.from_file(args.job) if getattr(args, "job", None) else None
    model = get_model(args.model) if args.model is not None else (base.actor if base else get_model("llama-3.1-8b"))
    gpu = get_gpu(args.gpu) if args.gpu is not None else (base.cluster.gpu if base else get_gpu("h100"))
    nodes = args.nodes if args.nodes is not None else (base.cluster.num_nodes if base else 2)
    gpn = args.gpus_per_node if args.gpus_per_node is not None else (base.cluster.gpus_per_node if base else 8)
    wl = base.workload.to_dict() if base else WorkloadSpec().to_dict()
    for opt, field in (("algo", "algorithm"), ("prompt_len", "prompt_len"), ("response_len", "response_len"),
                       ("prompts_per_step", "prompts_per_step"), ("samples_per_prompt", "samples_per_prompt"),
                       ("mini_batch", "mini_batch_size"), ("micro_batch", "micro_batch_size"),
                       ("ppo_epochs", "ppo_epochs"), ("recompute", "recompute"), ("lora_rank", "lora_rank")):
        v = getattr(args, opt, None)
        if v is not None:
            wl[field] = v
    _length_options(args, wl)
    if getattr(args, "no_reward_model", False):
        wl["reward_model"] = False
    if getattr(args, "asynchronous", False):
        wl["asynchronous"] = True
    if wl["algorithm"] != "grpo" and args.samples_per_prompt is None and not base:
        wl["samples_per_prompt"] = 4
    fw = get_framework(args.framework) if getattr(args, "framework", None) else (base.framework if base else
                                                                                 get_framework(DEFAULT_FRAMEWORK))
    job = JobSpec(actor=model, cluster=ClusterSpec(gpu, nodes, gpn), workload=WorkloadSpec(**wl), framework=fw)
    given = [getattr(args, k, None) for k in ("prompt_len", "response_len", "response_len_max", "response_lens")]
    return check_context(job) if any(v is not None for v in given) else job  # the lengths the user asked for


def _length_options(args, wl: dict) -> None:
    """--response-len-max, --response-lens / --response-len-percentile and --memory-fraction into
    the workload fields ``response_len_max``, ``response_len`` and ``memory_fraction``."""
    from nereus.spec.workload import read_response_lengths, response_len_stats

    lens, pct = getattr(args, "response_lens", None), getattr(args, "response_len_percentile", None)
    rmax = getattr(args, "response_len_max", None)
    if pct is not None and lens is None:
        raise ValueError(f"--response-len-percentile={pct:g} needs --response-lens FILE (the distribution it "
                         "is taken from); for a fixed length give --response-len-max")
    if lens is not None:
        if rmax is not None:
            raise ValueError(f"--response-len-max={rmax} and --response-lens are exclusive: give a length or a "
                             "distribution and a percentile")
        mean, rmax = response_len_stats(read_response_lengths(lens), 100.0 if pct is None else pct)
        if getattr(args, "response_len", None) is None:
            wl["response_len"] = mean
        rmax = max(rmax, wl["response_len"])
    if rmax is not None:
        wl["response_len_max"] = rmax
    if getattr(args, "memory_fraction", None) is not None:
        wl["memory_fraction"] = args.memory_fraction


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = ("terms: L_step is the predicted seconds of one RL step (the critical path through the "
                "workflow's stages); throughput is response tokens generated per second (rollouts x response "
                "length / L_step); peak GiB is the predicted peak memory per GPU, co-resident model-stages "
                "included. Job file format: docs/files.md.")
    add_job_arguments(p)
    o = p.add_argument_group("planning")
    o.add_argument("--pool", type=int, default=None, help="GPUs available (P_gpu), taken node by node "
                   "from GPU 0; default: the whole cluster")
    o.add_argument("--layout", nargs="+", action="extend", default=None, metavar="MS=TP,PP,DP",
                   help="what-if of your own layout: MODEL_STAGE=TP,PP,DP[,b=B][,rc=none|selective|full][,c=C] per "
                   "model-stage (e.g. actor.train=2,2,2 actor.generate=4,1,4,c=128); those left out take Nereus's "
                   "plan. Prints its time, per-GPU peak memory with its terms, fits or which term overflows by how "
                   "much, next to the best plan and the speedup")
    o.add_argument("--headroom", type=float, default=None, help="fraction of GPU memory kept free, in [0, 1) "
                   "(exclusive with --memory-fraction, which is 1 - headroom and travels with the job) [0.1]")
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the plan (and job) as JSON")
    out.add_argument("--breakdown", action="store_true", help="memory terms and time per op class")
    out.add_argument("--frontier", action="store_true", help="each model-stage's latency-vs-GPUs frontier")
    # --- integrations (nereus/integrations, docs/integrations.md) ---
    ig = p.add_argument_group("integrations (docs/integrations.md)")
    ig.add_argument("--from-verl", nargs="+", metavar=("CONFIG", "KEY=VALUE"), default=None,
                    help="import a verl trainer config (a YAML file, or ppo_trainer / ppo_megatron_trainer of the "
                    "installed verl) with Hydra-style overrides: evaluate its layout next to Nereus's best plan")
    ig.add_argument("--from-openrlhf", metavar="ARGS", default=None,
                    help="import an OpenRLHF train_ppo_ray argument string or launch line (quoted, or a script file), or a train_ppo "
                    "(DeepSpeed, no Ray) launch (its GPUs from --gpus-per-node/--nodes where deepspeed's line has "
                    "none), and evaluate its layout")
    ig.add_argument("--framework-version", type=framework_version_arg, default=None, metavar="NAME==VERSION",
                    help="the framework release the imported configuration runs (verl==0.4.1, openrlhf==0.5.9.post1): "
                    "selects the vLLM start-up memory rule and that release's defaults (docs/integrations.md); "
                    "default: the installed one")
    ig.add_argument("--export", choices=("verl", "openrlhf"), default=None,
                    help="write the plan as the framework's settings (the closest plan it can express)")


def _frontier(job, cost, pool_size, multi, as_json):
    res = search(cost, pool_size, multi, full_frontiers=True)
    out = {}
    for name in res.choice:
        lf = latency_frontier(res.frontiers[name])
        mb = job.workload.mini_batch_size
        out[name] = [{"gpus": int(lf.n[i]), "time": float(lf.t[i]), **{k: getattr(lf.candidate(i, mb), k)
                     for k in ("tp", "pp", "dp", "micro_batch", "concurrency", "recompute")}}
                     for i in range(len(lf))]
    if as_json:
        return out
    from rich.console import Console
    from rich.table import Table

    con = Console()
    for name, pts in out.items():
        t = Table(title=f"{name} frontier ({len(pts)} points)")
        for col in ("GPUs", "time (s)", "layout"):
            t.add_column(col)
        for pt in pts:
            t.add_row(str(pt["gpus"]), f"{pt['time']:.2f}", format_candidate(
                Candidate(name, pt["tp"], pt["pp"], pt["dp"], micro_batch=pt["micro_batch"],
                          concurrency=pt["concurrency"], recompute=pt["recompute"]), batch=True))
        con.print(t)
    return out


def framework_version_arg(text: str) -> tuple[str, str]:
    """``--framework-version NAME==VERSION`` as ``(name, version)``: NAME one of the importable
    frameworks (:data:`nereus.integrations.framework_versions.FRAMEWORKS`), VERSION a release number.

    Raises:
        argparse.ArgumentTypeError: another form, framework or version (argparse reports it at parse).
    """
    import argparse

    from nereus.integrations.framework_versions import FRAMEWORKS, version_key

    name, sep, version = str(text).partition("==")
    name = name.strip().lower()
    if not sep or name not in FRAMEWORKS or not version.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME==VERSION with NAME one of {list(FRAMEWORKS)} "
                                         "(e.g. verl==0.4.1, openrlhf==0.5.9.post1)")
    try:
        version_key(version.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    return name, version.strip()


def _version_for(args, framework: str):
    """The ``--framework-version`` release for an import of ``framework`` (None: the installed one).

    Raises:
        ValueError: the flag names another framework than the one imported.
    """
    fv = getattr(args, "framework_version", None)
    if fv is None:
        return None
    if fv[0] != framework:
        flag = "--from-verl" if framework == "verl" else "--from-openrlhf"
        raise ValueError(f"--framework-version {fv[0]}=={fv[1]} names {fv[0]}, but {flag} imports a {framework} "
                         f"configuration: give {framework}==VERSION")
    return fv[1]


def _warn_unknown(imp, unknown) -> None:
    """Each ``+key=value`` adding a key the installed verl does not have, noted as unknown to verl
    (in place of "not a key Nereus reads; ignored": verl never reads it either, so a memory or time
    setting meant by it does not take effect), with the closest key verl has."""
    from nereus.integrations.verl_config import _verl_version

    ver = _verl_version()
    for key, close in unknown:
        imp.notes = [n for n in imp.notes if not n.startswith(f"{key}=")]
        hint = f"; did you mean `{close}`?" if close else " (a key of another verl release?)"
        imp.notes.append(f"WARNING: +{key}: unknown key to verl {ver} (Hydra adds it, verl never reads it){hint}")


def _imported(args):
    """The job and layout of --from-verl / --from-openrlhf; job options (--gpu, --model, lengths) apply."""
    from dataclasses import replace

    if args.from_verl and args.from_openrlhf is not None:
        raise ValueError("--from-verl and --from-openrlhf are exclusive: import one configuration")
    if args.from_verl:
        from nereus.integrations.verl import import_verl
        from nereus.integrations.verl_config import load_verl_config, verl_launch

        cfg = load_verl_config(args.from_verl[0], args.from_verl[1:])
        imp = import_verl(cfg, model=args.model, gpu=args.gpu, version=_version_for(args, "verl"))
        _warn_unknown(imp, getattr(cfg, "unknown", ()))
        name = cfg.get("actor_rollout_ref", {}).get("rollout", {}).get("name")
        # "???": unset (OmegaConf's MISSING), read as vllm; check_rollout_names refused unknown names
        if name not in (None, "vllm", "???"):
            imp.notes.append(f"actor_rollout_ref.rollout.name={name!r}: timed and sized with vLLM's model "
                             f"(Nereus has no {name} time model; its memory pre-allocation is vLLM's)")
        config, overrides, _ = verl_launch(args.from_verl)
        # an export keeps the user's overrides as composed: legacy keys under the installed names
        imp.source = {"config": config, "overrides": list(getattr(cfg, "overrides", overrides)), "cfg": cfg}
    else:
        from nereus.integrations.common import launch_text
        from nereus.integrations.openrlhf import _tokens, import_openrlhf

        args.from_openrlhf = launch_text(args.from_openrlhf, "--from-openrlhf")  # a script file: its text
        imp = import_openrlhf(args.from_openrlhf, model=args.model, gpu=args.gpu, version=_version_for(args, "openrlhf"),
                              gpus_per_node=args.gpus_per_node, nodes=args.nodes)  # train_ppo: the machine
        imp.source = {"args": _tokens(args.from_openrlhf)}
    from nereus.cli.import_options import import_options

    wl = import_options(args, imp)
    if wl:
        imp.job = imp.job.with_workload(replace(imp.job.workload, **wl))
    check_context(imp.job, "prompt + response length")
    return imp



def _main_layout(args, job, cost, pool, best) -> int:
    """--layout: the user's layout evaluated next to Nereus's best plan (nereus.planner.whatif)."""
    from nereus.planner.whatif import whatif

    rep, ev = whatif(job, args.layout, cost=cost, pool=pool, best=best)
    if args.json:
        doc = {"feasible": rep["nereus"]["feasible"], "job": job.to_dict(), "layout": rep["layout"]}
        doc |= {"plan": rep["nereus"]["plan"]} if best is not None else {"reason": rep["nereus"]["reason"]}
        if "speedup" in rep:
            doc["speedup"] = rep["speedup"]
        print(json.dumps(doc, indent=2))
        return 0
    print("your layout (--layout):")
    print_layout_eval(rep["layout"], ev.plan.candidates, rep["layout"]["from_nereus"])
    if best is None:
        print(f"Nereus: {rep['nereus']['reason']}")
        return 0
    print("Nereus's best plan for the same job:")
    print_plan(best, job, args.breakdown)
    if "speedup" in rep:
        print(f"predicted speedup of Nereus's plan over yours: {rep['speedup']:.2f}x")
    return 0


def _print_import(rep: dict, imp) -> None:
    w = imp.job.workload
    print(f"imported from {imp.framework}: {imp.job.actor.name} {w.algorithm.upper()} on {imp.job.cluster.num_gpus} x "
          f"{imp.job.cluster.gpu.name}; prompts {w.prompts_per_step} x {w.samples_per_prompt}, prompt {w.prompt_len}, "
          f"response {w.response_len} tokens, mini-batch {w.mini_batch_size}")
    for n in imp.notes:
        print(f"  note: {n}")
    print("your layout:")
    ev = rep["user"].get("evaluation")
    if ev:
        print_layout_eval(ev, imp.layout)
        return
    width = max(len(c.model_stage) for c in imp.layout)
    for c in imp.layout:
        print(f"  {c.model_stage:<{width}}  {format_candidate(c, 'GPUs', batch=True)}")
    print("not expressible in Nereus's plan space yet, so not evaluated:")
    for u in imp.unexpressible:
        print(f"  - {u}")


def _main_integrations(args) -> int:
    from nereus.integrations.common import compare, launch_error, model_override_notes

    given = ("--from-verl", args.from_verl) if args.from_verl else ("--from-openrlhf", args.from_openrlhf)
    try:
        imp = _imported(args)
    except ValueError as e:
        raise launch_error(e, *given) from None
    imp.notes = model_override_notes(imp.notes, args.model)
    rep = compare(imp, headroom=args.headroom)
    best = rep["nereus"]
    if args.export:
        if not best["feasible"]:
            raise ValueError(f"--export: Nereus found no plan for the imported job: {best['reason']}")
        same = imp.framework == args.export
        from nereus.cli.plan_export import export_plan

        return export_plan(args, imp.job, plan_from(best["plan"]), imp.source if same else None,
                           None if same else imp.source)  # another framework: the settings it has equivalents for
    if args.json:
        print(json.dumps(rep, indent=2, default=str))
        return 0
    _print_import(rep, imp)
    if not best["feasible"]:
        print(f"Nereus: {best['reason']}")
        return 1
    print("Nereus's best plan for the same job:")
    from nereus.spec.plan import Plan

    print_plan(Plan.from_dict(best["plan"]), imp.job, args.breakdown)
    if "speedup" in rep:
        print(f"predicted speedup of Nereus's plan over yours: {rep['speedup']:.2f}x")
    return 0


def plan_from(d):
    from nereus.spec.plan import Plan

    return Plan.from_dict(d)


def main(args) -> int:
    if getattr(args, "layout", None) and (getattr(args, "from_verl", None) or getattr(args, "from_openrlhf", None)):
        raise ValueError("--layout and --from-verl/--from-openrlhf are exclusive: an import evaluates the "
                         "framework's own layout")
    if getattr(args, "from_verl", None) or getattr(args, "from_openrlhf", None) is not None:  # "" is refused there
        return _main_integrations(args)
    if getattr(args, "framework_version", None) is not None:
        raise ValueError("--framework-version applies to an imported configuration: give --from-verl or "
                         "--from-openrlhf")
    job = job_from_args(args)
    pool = None
    if args.pool is not None:
        if args.pool <= 0 or args.pool > job.cluster.num_gpus:
            raise ValueError(f"--pool={args.pool} must be between 1 and the cluster's "
                             f"{job.cluster.num_gpus} GPUs")
        pool = frozenset(range(args.pool))
    if args.headroom is not None and getattr(args, "memory_fraction", None) is not None:
        raise ValueError(f"--headroom={args.headroom:g} and --memory-fraction={args.memory_fraction:g} are "
                         "exclusive (memory fraction = 1 - headroom); give one")
    cost = CostModel(job, headroom=args.headroom)
    try:
        plan = plan_job(job, pool=pool, cost=cost)
    except NoFeasiblePlan as e:
        if args.layout:
            return _main_layout(args, job, cost, pool, None)
        if args.json:
            print(json.dumps({"feasible": False, "reason": str(e), "diagnosis": e.diagnosis,
                              "job": job.to_dict()}, indent=2))
        else:
            print(str(e), file=sys.stderr)
        return 1
    pool_set = pool or job.cluster.all_gpus()
    if args.layout:
        if getattr(args, "export", None) or args.frontier:
            raise ValueError("--layout evaluates your layout next to the best plan; it does not combine with "
                             "--export or --frontier")
        return _main_layout(args, job, cost, pool, plan)
    if getattr(args, "export", None):
        from nereus.cli.plan_export import export_plan

        return export_plan(args, job, plan)
    if args.json:
        doc = {"feasible": True, "job": job.to_dict(), "plan": plan.to_dict()}
        if args.frontier:
            doc["frontier"] = _frontier(job, cost, len(pool_set), job.cluster.spans_nodes(pool_set), True)
        print(json.dumps(doc, indent=2))
        return 0
    print_plan(plan, job, args.breakdown)
    if args.frontier:
        _frontier(job, cost, len(pool_set), job.cluster.spans_nodes(pool_set), False)
    return 0
