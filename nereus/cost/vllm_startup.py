"""What vLLM does at start-up with the memory other model-stages hold on its GPUs, by vLLM version.

:mod:`nereus.cost.vllm_memory` sizes a generation engine as if it were alone: ``E = f·M - workspace``
bytes beyond the per-GPU workspace (``f`` = ``gpu_memory_utilization``, ``M`` = device memory). When
training model-stages share the engine's GPUs (verl's hybrid engine, OpenRLHF's colocation), what
vLLM does with their bytes depends on its version. The workload's ``vllm_memory_rule`` names it:

* ``startup_check`` (None, the default: vLLM >= 0.9.1, V1 ``Worker.init_device`` /
  ``vllm/v1/worker/utils.py::request_memory``): ``requested_memory = M · f``; the worker raises
  "Free memory on device (...) on startup is less than desired GPU memory utilization" when the
  free memory at start is below it; the KV cache gets ``requested_memory - non_kv_cache_memory``
  (its own weights, profiled activations, non-torch increase). So the engine holds ``f·M`` whatever
  else is on the GPU, and refuses to start when ``M - workspace - S < f·M``, ``S`` the bytes the
  co-located model-stages hold when it starts. The check appeared with vLLM 0.9.1 (vLLM issue 20305,
  "vLLM v0.9.1 Free Memory on device on startup is less than desired"; vllm-project/llm-compressor
  PR 1560: "we started seeing the following failure ... starting from version 0.9.1").
* ``device_total`` (vLLM 0.8.x V1, ``vllm/v1/worker/gpu_worker.py::determine_available_memory`` at
  vllm-project/vllm@0012cf69): ``available = M · f - peak``, where ``peak`` adds to this process's
  torch peak the device's non-torch bytes (``mem_get_info`` used minus torch's own), which include
  other processes: the engine fills the device up to ``f·M`` counting what is already there:
  ``E = f·M - workspace - S``; no start-up refusal (a KV budget below one sequence is still refused,
  as :func:`~nereus.cost.vllm_memory.preallocated_memory` says).
* ``free_share`` (verl's patched vLLM <= 0.6.3, ``verl/third_party/vllm/vllm_v_0_6_3/worker.py``
  ``determine_num_available_blocks``, verl 0.1 as TinyZero ships it, Jiayi-Pan/TinyZero@95df88f):
  ``num_gpu_blocks = free_gpu_memory · f // block`` with ``free`` measured after the engine's
  weights and profile run: the KV cache is the fraction ``f`` of what everything else left:
  ``KV = f · (M - workspace - S - W - A - L)`` (weights, activations, logits of the engine), sized
  once at start-up and re-allocated at that size for every generation.

``S`` (start-up bytes): what the co-located model-stages hold before the first training step. A
training model-stage's resident bytes less two thirds of its Adam state: torch's Adam creates
``exp_avg`` / ``exp_avg_sq`` at the first step (``torch.optim.Adam._init_group``), so they are not
there yet, while the fp32 master copy (the other third) is; that leaves its weights and master copy,
plus what its framework keeps resident besides (:mod:`nereus.cost.train_state`: Megatron's gradient
buffer, allocated when DDP wraps the model; verl FSDP's fp32 parameters stand for weights and master
copy at once). An inference model-stage's weights; nothing for an offloaded one. The steady-state
bytes (Adam state, transient gradients) are what the plan check adds on top.

Under every rule a KV budget that does not hold one sequence at the memory length means vLLM does
not start (the device's bytes plus the shortfall, as :mod:`nereus.cost.vllm_memory` marks it). The
rule changes the engine's memory; its decode concurrency in the time estimate is still capped by the
KV blocks of ``f·M`` (:func:`~nereus.cost.vllm_memory.kv_capacity`), so under ``device_total`` and
``free_share`` the generation time may assume more sequences at once than the smaller cache holds.
"""

from __future__ import annotations

from dataclasses import replace

from nereus.cost.shapes import kv_bytes_per_token_rank
from nereus.spec.workload import VLLM_MEMORY_RULES

__all__ = ["startup_bytes", "startup_shortfall", "engine_bytes_for", "apply_vllm_rule", "gpu_excess"]

def startup_bytes(stage: str, memory: dict, resident: float) -> float:
    """Bytes a co-located model-stage holds when the engine starts (module docstring): 0 when its
    state is not resident (offloaded); a ``train`` model-stage's ``resident - 2/3 · optimizer`` (its
    resident bytes less Adam's two moments, made at the first step: ``weights + optimizer / 3``, plus
    a resident gradient buffer); another's ``weights``."""
    if resident <= 0:
        return 0.0
    if stage == "train":
        return float(resident) - 2.0 * float(memory.get("optimizer", 0.0)) / 3.0
    return float(memory.get("weights", 0.0))


def startup_shortfall(fraction: float, device_bytes: float, workspace: float, others: float) -> float:
    """Bytes by which vLLM >= 0.9.1 finds too little free at start: ``f·M - (M - workspace - S)``,
    0 when it starts (``startup_check``)."""
    return max(0.0, float(fraction) * device_bytes - (device_bytes - workspace - others))


def engine_bytes_for(rule: str | None, fraction: float, device_bytes: float, workspace: float, others: float,
                     memory: dict) -> tuple[float, float]:
    """``(E, kv)``: the engine's bytes beyond the workspace and its KV-cache bytes under ``rule``
    with ``others`` (``S``) on the GPU; ``memory``: the engine's terms (``weights``,
    ``activations``, ``logits``). ``startup_check`` refused: ``E = M + shortfall`` (never fits;
    the excess says by how much), as :mod:`nereus.cost.vllm_memory` marks an engine that cannot start.

    Raises:
        ValueError: an unknown rule.
    """
    own = float(memory.get("weights", 0.0)) + float(memory.get("activations", 0.0)) + float(memory.get("logits", 0.0))
    rule = rule or "startup_check"
    if rule == "startup_check":
        short = startup_shortfall(fraction, device_bytes, workspace, others)
        e = fraction * device_bytes - workspace
        return (device_bytes + short, e - own) if short > 0 else (e, e - own)
    if rule == "device_total":
        e = fraction * device_bytes - workspace - others
        return e, e - own
    if rule == "free_share":
        kv = max(0.0, fraction * (device_bytes - workspace - others - own))
        return own + kv, kv
    raise ValueError(f"workload field 'vllm_memory_rule' must be one of {VLLM_MEMORY_RULES} or null, got {rule!r}")


def apply_vllm_rule(job, candidates, ests: dict, workspace: float, owned=frozenset()) -> dict:
    """``ests`` with every pre-allocated generation engine (``rollout_memory_fraction`` set) resized
    for what the other model-stages on its GPUs hold at start-up (module docstring); the engine's
    ``S`` is that of its fullest GPU (verl's worker takes the MIN of the KV blocks over the TP group;
    vLLM >= 0.9.1 refuses when one rank refuses). ``owned``: inference model-stages whose weights are
    their training engine's (counted once). An engine that fails one sequence at the memory length
    (its bytes above the device already) is left as it is.
    """
    w = job.workload
    f = w.rollout_memory_fraction
    if f is None:
        return ests
    m = job.cluster.gpu.memory_bytes
    out = dict(ests)
    for c in candidates:
        stage = c.model_stage.split(".")[1]
        e = ests[c.model_stage]
        if stage != "generate" or e.peak_own > m:
            continue
        per_gpu: dict = {}
        for o in candidates:
            if o is c or o.model_stage in owned or o.model_stage.endswith(".generate"):
                continue
            s = startup_bytes(o.model_stage.split(".")[1], ests[o.model_stage].memory, ests[o.model_stage].resident)
            for g in set(o.gpus) & set(c.gpus):
                per_gpu[g] = per_gpu.get(g, 0.0) + s
        others = max(per_gpu.values(), default=0.0)
        total, kv = engine_bytes_for(w.vllm_memory_rule, f, m, workspace, others, e.memory)
        model = job.model(c.model_stage.split(".")[0])
        one = w.memory_seq_len * float(kv_bytes_per_token_rank(model, w.kv_bytes, c.tp, c.pp))
        if total <= m and kv < one:  # vLLM refuses: "max seq len is larger than ... tokens ... in KV cache"
            total = m + (one - kv)
        memory = dict(e.memory, kv_cache=max(kv, 0.0))
        sleeps = e.resident == 0.0
        out[c.model_stage] = replace(e, memory=memory, resident=0.0 if sleeps else total,
                                     transient=total if sleeps else 0.0)
    return out


def gpu_excess(job, plan, headroom: float, workspace: float, owned=frozenset()) -> dict:
    """GPU id -> bytes over what the plan check allows (<= 0: fits), the headroom applied to the
    predicted bytes and not to a pre-allocated vLLM engine's, which vLLM sized itself (``f·M``, or
    as :func:`engine_bytes_for` says): per phase on the GPU, ``workspace + predicted <= (1 -
    headroom) · (M - exact)``, with ``exact`` the engine bytes present in that phase (its resident
    bytes always, its transient bytes while it generates) and ``predicted`` the other model-stages'
    resident bytes plus the running one's transient bytes. Without a pre-allocated engine this is
    the usual ``workspace + Σ resident + max transient <= (1 - headroom) · M``.
    ``plan``: estimated (its ``estimates``); ``owned``: as :func:`apply_vllm_rule`.
    """
    m = job.cluster.gpu.memory_bytes
    pre = job.workload.rollout_memory_fraction is not None
    res: dict = {}
    tr: dict = {}
    e_res: dict = {}
    e_tr: dict = {}
    for c in plan.candidates:
        e = plan.estimates[c.model_stage]
        engine = pre and c.model_stage.endswith(".generate")
        for g in c.gpus:
            if engine:
                e_res[g] = e_res.get(g, 0.0) + e.resident
                e_tr[g] = max(e_tr.get(g, 0.0), e.transient)
            else:
                res[g] = res.get(g, 0.0) + (0.0 if c.model_stage in owned else e.resident)
                tr[g] = max(tr.get(g, 0.0), e.transient)
    out = {}
    for g in set(res) | set(e_res):
        r, er = res.get(g, 0.0), e_res.get(g, 0.0)
        phases = [(workspace + r + tr.get(g, 0.0), er)]
        if g in e_res:
            phases.append((workspace + r, er + e_tr[g]))
        out[g] = max(pred - (1.0 - headroom) * (m - exact) for pred, exact in phases)
    return out
