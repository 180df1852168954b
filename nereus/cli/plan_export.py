"""``nereus plan --export verl|openrlhf``: a plan written as the framework's settings (the verl
overrides quoted for bash, :mod:`nereus.integrations.verl_command`; OpenRLHF's command line), with the
user's settings carried across (:mod:`nereus.integrations.export_carry`)."""

from __future__ import annotations

import json

__all__ = ["export_plan"]


def export_plan(args, job, plan, source=None, carry=None) -> int:
    """Print (or ``--json``) ``plan`` as the settings of ``args.export`` (``verl`` or ``openrlhf``): the
    closest plan that framework can express, its time against Nereus's plan, what changed, and the
    user's own settings carried from ``source`` (same framework) or ``carry`` (the other one).

    Returns:
        0 (the command's exit status).
    """
    from nereus.integrations.export_carry import carry_settings, export_model_path, merge_carried
    from nereus.planner.notation import format_plan

    carried, carry_notes = carry_settings(args.export, carry, job) if carry else ([], [])
    model_path = export_model_path(args.model)
    if any(c.startswith(("--actor.model_name_or_path", "actor_rollout_ref.model.path=")) for c in carried):
        model_path = None  # the user's own model path is carried
    if args.export == "verl":
        from nereus.integrations.verl_export import export_verl

        # an FSDP job (imported from verl's FSDP backend, or --framework fsdp) may also export to FSDP
        backends = ("megatron", "fsdp") if "fsdp" in job.framework.name else ("megatron",)
        ex = export_verl(job, plan, args.headroom, model_path, backends=backends, user=source)
        ex["overrides"] = merge_carried(ex["overrides"], carried)
        from nereus.integrations.verl_command import verl_command

        ex["command"] = verl_command(ex["config_name"], ex["overrides"])  # quoted for bash
        settings = [ex["command"]]
    else:
        from nereus.integrations.openrlhf_export import export_openrlhf

        ex = export_openrlhf(job, plan, args.headroom, model_path,
                             user_args=(source or {}).get("args") or (carried if carry else None))
        settings = [ex["command"]]
    ev, ex["carry_notes"] = ex["evaluation"], carry_notes
    if args.json:
        print(json.dumps({k: v for k, v in ex.items() if k not in ("layout", "evaluation")} |
                         {"evaluation": ev.to_dict(), "job": job.to_dict()}, indent=2, default=str))
        return 0
    print(f"Nereus's plan: L_step {plan.l_step:.2f} s")
    print(f"closest plan {args.export} can express: L_step {ex['l_step']:.2f} s ({ex['slowdown']:.2f}x); {ex['note']}")
    print(format_plan(ev.plan, unit="GPUs", batch=True, indent="  "))
    if not ev.fits:
        print("  does NOT fit: " + "; ".join(f"{k}: {v}" for k, v in ev.overflow.items()))
    head = f"what changed from Nereus's plan to the {args.export} plan (not from your layout)"
    print(f"{head}:" if ex["changes"] else f"{head}: nothing")
    for ch in ex["changes"]:
        print(f"  {ch}")
    for n in carry_notes:
        print(f"  note: {n}")
    print(f"{args.export} settings:")
    print("\n".join(settings))
    return 0
