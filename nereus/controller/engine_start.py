"""Seconds to (re)start a rollout engine on a new generation layout, and communicator creation at scale.

A generation model-stage that changes its (tp, pp) layout, or gains GPUs, needs new vLLM engine
processes on its target GPUs: spawn the workers, create their TP/PP communicators, load (or receive)
the weights, profile memory, allocate the paged KV cache, compile and capture CUDA graphs. Moving
the weights (the transition DAG's job) does not cover this, and it is the largest part of a
generation re-layout for large models. Replicas start in parallel, so a transition pays the start
of its slowest new engine.

Model (seconds; ``P`` the model's parameter count in billions, ``tp · pp`` the engine's GPUs)::

    engine_start_s = ENGINE_BASE_S + ENGINE_PER_BPARAM_S · P + ENGINE_RANK_S · log2(tp · pp)

* the ``log2`` term: initialisation grows with the tensor-parallel size (worker processes started
  through Ray and a communicator per group; vLLM issue #10283, "LLM initialization time increases
  significantly with larger tensor parallel size and Ray"); ``ENGINE_RANK_S`` = 5 s per doubling is an
  assumption of that order;
* the two other constants are fitted to two reported starts: about 25 s for an 8B model on one GPU
  (the CUDA-graph capture alone takes 10–30 s for 7–8B models in vLLM's logs; a cold start of
  Llama-3.1-8B with weights already on local disk is of that order in Tensorfuse's breakdown,
  "Reducing GPU cold start time when using vLLM", 2025), and about 3.5 minutes for a 70B model at
  TP 8 (reported by vLLM users, e.g. vLLM issue #10702 for Llama-3.1-70B TP 8 from a slower disk; the
  brief of issue 29): ``base + 8·k = 25`` and ``base + 70·k + 3·5 = 210`` give ``k = 2.74`` s per
  billion parameters and ``base = 3.1`` s. It is a fit through two points, not a mechanism: compile,
  graph capture and weight loading all grow with the model's size.

Resulting figures: 8B TP 1 25 s, 8B TP 2 30 s, Qwen3-32B TP 4 103 s, 70B TP 8 211 s.

Communicator creation at scale (``group_init_s``): a transition that changes a training layout
creates the new TP/PP/DP process groups over all of its target GPUs; NCCL's bootstrap is an
all-gather of unique ids among the ranks, so creating a world of ``N`` ranks takes time growing with
``N``. ``COMM_INIT_PER_LOG2_S`` = 1 s per doubling (8 GPUs 3 s, 64 GPUs 6 s) is an assumption of the
order reported for ``torch.distributed`` initialisation at scale (seconds to tens of seconds); the
live executor's measured per-group setup (0.26–0.49 s for many groups on 4 CPU workers,
docs/live-transition.md) is a lower bound.
"""

from __future__ import annotations

import math

from nereus.spec.model import ModelSpec
from nereus.spec.plan import Plan

__all__ = ["engine_start_s", "generation_restart_s", "group_init_s", "ENGINE_BASE_S", "ENGINE_PER_BPARAM_S",
           "ENGINE_RANK_S", "COMM_INIT_PER_LOG2_S"]

#: fixed seconds of an engine start (module docstring: fitted with ``ENGINE_PER_BPARAM_S``).
ENGINE_BASE_S = 3.1
#: seconds per billion parameters of an engine start (module docstring).
ENGINE_PER_BPARAM_S = 2.74
#: seconds per doubling of an engine's GPUs (Ray workers and communicators; module docstring).
ENGINE_RANK_S = 5.0
#: seconds per doubling of the GPUs of the process groups a training re-layout creates.
COMM_INIT_PER_LOG2_S = 1.0


def engine_start_s(model: ModelSpec, tp: int, pp: int = 1) -> float:
    """Seconds to start one rollout-engine replica of ``model`` on ``tp · pp`` GPUs (module docstring).

    Raises:
        ValueError: ``tp`` or ``pp`` not a positive integer.
    """
    for name, v in (("tp", tp), ("pp", pp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"engine start field {name!r} must be an integer >= 1, got {v!r}")
    return ENGINE_BASE_S + ENGINE_PER_BPARAM_S * model.num_params / 1e9 + ENGINE_RANK_S * math.log2(tp * pp)


def generation_restart_s(models: dict, current: Plan, target: Plan) -> float:
    """Seconds of engine starts of ``current → target``: the slowest :func:`engine_start_s` among the
    ``*.generate`` model-stages that change layout or gain GPUs (replicas start in parallel); 0 when
    none does.

    Args:
        models: model name (``actor``, ...) → :class:`ModelSpec`, or a callable ``name -> ModelSpec``.
    """
    get = models if callable(models) else models.__getitem__
    worst = 0.0
    for t in target.candidates:
        if not t.model_stage.endswith(".generate"):
            continue
        c = current[t.model_stage] if t.model_stage in current else None
        if c is None or c.layout != t.layout or not set(t.gpus) <= set(c.gpus):
            worst = max(worst, engine_start_s(get(t.model_stage.split(".")[0]), t.tp, t.pp))
    return worst


def group_init_s(current: Plan, target: Plan) -> float:
    """Seconds to create the process groups of the ``*.train`` model-stages whose layout or GPUs change:
    ``COMM_INIT_PER_LOG2_S · log2(N)`` with ``N`` the largest such model-stage's target GPUs (groups of
    different model-stages are created concurrently); 0 when no training layout changes."""
    n = 0
    for t in target.candidates:
        if not t.model_stage.endswith(".train"):
            continue
        c = current[t.model_stage] if t.model_stage in current else None
        if c is None or c.key() != t.key() or c.gpus != t.gpus:
            n = max(n, len(t.gpus))
    return COMM_INIT_PER_LOG2_S * math.log2(n) if n > 1 else 0.0
