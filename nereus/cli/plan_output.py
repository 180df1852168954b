"""How ``nereus plan`` prints a plan and an evaluated layout: the per-model-stage table (degrees, batch,
GPUs or co-located blocks, seconds, peak GiB), ``--breakdown``'s memory terms and op-class seconds, and
the memory the plan is allowed per GPU.
"""

from __future__ import annotations

from nereus.planner.notation import format_candidate, format_gpus
from nereus.planner.whatif import shared_stages
from nereus.spec.framework import DEFAULT_FRAMEWORK
from nereus.spec.hardware import GIB

__all__ = ["print_plan", "print_layout_eval", "stage_blocks", "allowed_memory"]


def print_plan(plan, job, breakdown: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    w = job.workload
    con.print(f"[bold]{job.actor.name}[/] {w.algorithm.upper()} on {job.cluster.num_gpus} x "
              f"{job.cluster.gpu.name} ({job.cluster.num_nodes} node(s) x {job.cluster.gpus_per_node}); "
              f"prompts {w.prompts_per_step} x {w.samples_per_prompt}, prompt {w.prompt_len}, response "
              f"{w.response_len} tokens" + (f" (memory sized at {w.response_len_max})"
                                            if w.response_len_max is not None else "")
              + (f"; framework {job.framework.name}" if job.framework.name != DEFAULT_FRAMEWORK else ""))
    t = Table(show_lines=False)
    opts = any(c.zero or c.vpp > 1 or c.offload != "none" for c in plan.candidates)
    cols = ("model-stage", "tp", "pp", "dp", "batch") + (("options",) if opts else ()) + ("GPUs", "time (s)",
                                                                                         "peak GiB")
    for col in cols:
        t.add_column(col, justify="right" if col not in ("model-stage", "GPUs", "batch", "options") else "left")
    for c in plan.candidates:
        e = plan.estimates[c.model_stage]
        batch = f"c={c.concurrency}" if c.concurrency else f"b={c.micro_batch}"
        if c.grad_accum:
            batch += f" a={c.grad_accum}"
        if c.recompute != "none":
            batch += f" rc={c.recompute}"
        extra = [" ".join(x for x in (f"z{c.zero}" if c.zero else "", f"v{c.vpp}" if c.vpp > 1 else "",
                                      f"off:{c.offload}" if c.offload != "none" else "") if x)] if opts else []
        t.add_row(c.model_stage, str(c.tp), str(c.pp), str(c.dp), batch, *extra, format_gpus(c.gpus),
                  f"{e.time:.2f}", f"{plan.peak_memory[c.model_stage] / GIB:.1f}")
    con.print(t)
    if opts:
        con.print("options: zN = ZeRO stage N, vN = N interleaved pipeline chunks per rank, off:host / off:drop = idle "
                  "state offloaded to host memory / dropped and reloaded, off:cpu_adam = optimizer state and step on "
                  "the CPU (ZeRO-Offload)")
    shared = shared_stages(plan.candidates)
    if shared:
        con.print(f"colocated (model-stages share GPUs and run one after another): {', '.join(shared)}")
        for st, blocks in stage_blocks(plan.candidates).items():
            if st in shared and len(blocks) > 1:  # mixed: colocated blocks side by side on disjoint GPUs
                con.print(f"  {st} mixed, blocks side by side: " + " | ".join(" + ".join(b) for b in blocks))
    if breakdown:
        b = Table(title="breakdown (own bytes per GPU; seconds per op class)")
        b.add_column("model-stage")
        b.add_column("memory GiB")
        b.add_column("time by op class (s)")
        for c in plan.candidates:
            e = plan.estimates[c.model_stage]
            mem = ", ".join(f"{k} {v / GIB:.1f}" for k, v in e.memory.items() if v > 0)
            tm = ", ".join(f"{k} {v:.2f}" for k, v in sorted(e.breakdown.items(), key=lambda kv: -kv[1]))
            b.add_row(c.model_stage, mem, tm)
        con.print(b)
    con.print(f"L_step = [bold]{plan.l_step:.2f} s[/]   throughput = [bold]{plan.throughput:,.0f}[/] "
              f"response tokens/s   max GPU memory = {max(plan.gpu_memory.values()) / GIB:.1f} of "
              f"{plan.capacity / GIB:.1f} GiB allowed ({allowed_memory(job, plan)})")


def stage_blocks(cands) -> dict:
    """Per stage, its model-stages grouped by shared GPUs (connected GPU sets), in candidate order."""
    out: dict = {}
    for st in dict.fromkeys(c.model_stage.split(".")[1] for c in cands):
        groups: list = []  # [names, gpus]
        for c in (c for c in cands if c.model_stage.split(".")[1] == st):
            hit = [g for g in groups if g[1] & set(c.gpus)]
            merged = [[c.model_stage], set(c.gpus)]
            for g in hit:
                merged = [g[0] + merged[0], g[1] | merged[1]]
                groups.remove(g)
            groups.append(merged)
        out[st] = [tuple(g[0]) for g in groups]
    return out


def allowed_memory(job, plan) -> str:
    dev = job.cluster.gpu.memory_bytes
    f = job.workload.memory_fraction
    if f is not None and abs(plan.capacity - f * dev) < 1.0:
        return f"memory fraction {f:g} of {dev / GIB:.1f} GiB"
    return "device memory less headroom"


def print_layout_eval(evd: dict, cands, from_nereus=()) -> None:
    """Per model-stage: layout, time, peak GiB, own memory terms and any overflow; then L_step."""
    width = max(len(c.model_stage) for c in cands)
    for c in cands:
        m = evd["model_stages"][c.model_stage]
        terms = ", ".join(f"{k} {v:.1f}" for k, v in sorted(m["memory_gib"].items(), key=lambda kv: -kv[1]))
        tag = "  (from Nereus's plan)" if c.model_stage in from_nereus else ""
        print(f"  {c.model_stage:<{width}}  {format_candidate(c, 'GPUs', batch=True)}  {m['time_s']:.2f} s, peak "
              f"{m['peak_gib']:.1f} GiB [{terms}]{tag}" + (f"\n  {'':<{width}}  OVER: {m['overflow']}"
                                                         if m["overflow"] else ""))
    fits = "fits" if evd["fits"] else "does NOT fit in memory"
    print(f"predicted L_step = {evd['l_step']:.2f} s; {fits} ({evd['capacity_gib']:.1f} GiB allowed per GPU)")
