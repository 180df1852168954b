"""Job options of ``nereus plan`` given next to ``--from-verl`` / ``--from-openrlhf`` (issue 28: "empty or
contradictory inputs refused"): an option the imported configuration also sets must agree with it;
``--prompt-len`` / ``--response-len`` are measured means, at most the configuration's maxima."""

from __future__ import annotations

__all__ = ["IMPORT_SET", "import_options"]


#: job options of ``nereus plan`` that an imported configuration also sets: (option, its flag, the job's value)
IMPORT_SET = (("algo", "--algo", lambda j: j.workload.algorithm),
               ("nodes", "--nodes", lambda j: j.cluster.num_nodes),
               ("gpus_per_node", "--gpus-per-node", lambda j: j.cluster.gpus_per_node),
               ("prompts_per_step", "--prompts-per-step", lambda j: j.workload.prompts_per_step),
               ("samples_per_prompt", "--samples-per-prompt", lambda j: j.workload.samples_per_prompt),
               ("mini_batch", "--mini-batch", lambda j: j.workload.mini_batch_size),
               ("micro_batch", "--micro-batch", lambda j: j.workload.micro_batch_size),
               ("ppo_epochs", "--ppo-epochs", lambda j: j.workload.ppo_epochs),
               ("recompute", "--recompute", lambda j: j.workload.recompute),
               ("lora_rank", "--lora-rank", lambda j: j.workload.lora_rank))


def import_options(args, imp) -> dict:
    """The workload fields the command line changes on an imported job: ``--prompt-len`` and
    ``--response-len`` (measured means, at most the configuration's maxima, noted). Any other job option
    the configuration also sets must agree with it (an OpenRLHF ``train_ppo`` line takes its machine
    from ``--nodes``/``--gpus-per-node``, so those agree by construction).

    Raises:
        ValueError: a job option that contradicts the imported configuration (the option, both values),
            or a length above the configuration's maximum.
    """
    for opt, flag, value in IMPORT_SET:
        v = getattr(args, opt, None)
        if v is not None and v != value(imp.job):
            raise ValueError(f"{flag} {v} contradicts the imported {imp.framework} configuration, which sets "
                             f"{value(imp.job)}: change the configuration, or drop {flag}")
    wl = {}
    for opt, flag, field in (("prompt_len", "--prompt-len", "prompt_len"),
                             ("response_len", "--response-len", "response_len")):
        v = getattr(args, opt, None)
        if v is None:
            continue
        cap = getattr(imp.job.workload, field)
        if v > cap:
            raise ValueError(f"{flag} {v} is longer than the imported configuration's maximum of {cap} tokens: "
                             f"a mean length is at most the maximum (valid: 1-{cap})")
        wl[field] = v
        imp.notes.append(f"{flag} {v}: the mean length used for time and memory (the configuration's maximum "
                         f"is {cap})")
    return wl
