"""Op-class seconds of the engine terms of :class:`nereus.spec.engine.EngineCosts` (issue 27).

* Decode steps of a synchronous generation (``generation="longest"``): a batch ends when its longest
  response ends, so a replica with ``n`` sequences of mean length ``L`` and longest ``L_max`` at
  concurrency ``c`` runs ``S = max(L_max, ceil(n·L/c))`` decode steps: at least the longest response
  (each step adds one token to each running sequence), and at least the token volume over the
  concurrency (continuous batching keeps ``c`` sequences running while there are any left; vLLM's
  iteration-level scheduling, Kwon et al. SOSP'23, Yu et al. Orca OSDI'22). On average
  ``r = n·L/S`` sequences run per step (the ``n·L`` tokens spread over ``S`` steps), which is what
  each step's KV reads and FLOPs are charged at. ``generation="mean"`` keeps the old model
  (``waves·L`` steps at the full concurrency).
* Engine overhead per decode step ``S·(a + b·r)`` (``decode_step_s``, ``decode_seq_s``), op class
  ``decode_overhead``: the scheduler, sampler and launch work a decode step costs outside the
  kernels, which vLLM serialises with the GPU work in its synchronous engine loop (vLLM RFC #6854:
  "GPU is often idle, waiting for CPU operations (5-13ms of GPU bubble)" per decode step with CUDA
  graphs; more in eager mode, where every kernel is launched from Python).
* Per generate call ``generate_call_s``, op class ``engine`` (engine wake: KV-cache re-allocation,
  loading the synced weights).
* Per layer per micro-batch pass ``layer_pass_s``, op class ``launch``: a fixed latency of each
  layer call in an eager training/inference engine, which large micro-batches hide behind their
  kernels and small ones do not (the achieved FLOP/s falls with the micro-batch's tokens as
  ``t_kernels / (t_kernels + t_launch)``). Passes per micro-batch: 1 forward-only, 3 forward and
  backward, 4 with full recompute (the backward counted as two layer calls).
* Fixed per RL step ``step_s``, op class ``framework``.

Every overhead is ``base / efficiency(class)`` with default efficiency 1
(:data:`nereus.cost.efficiency.DEFAULT_EFFICIENCY`), so calibration scales them like kernel classes.
Elementwise over NumPy arrays.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from nereus.cost.efficiency import EfficiencyTable
from nereus.spec.engine import EngineCosts
from nereus.spec.workload import WorkloadSpec

__all__ = ["OVERHEAD_CLASSES", "decode_steps", "decode_overhead_times", "generate_call_times", "layer_pass_times",
           "step_overhead", "padded_workload"]

#: op classes of the engine terms
OVERHEAD_CLASSES = ("decode_overhead", "engine", "launch", "framework")


def decode_steps(seqs, concurrency, mean_len: float, max_len: float):
    """``(S, r)``: decode steps ``max(L_max, ceil(n·L/c))`` of a replica with ``seqs`` (``n``)
    sequences of mean length ``mean_len`` (``L``) and longest ``max_len`` (``L_max``) at
    ``concurrency`` (``c``), and the mean running sequences per step ``r = n·L/S``.

    Raises:
        ValueError: ``max_len < mean_len`` or non-positive lengths.
    """
    if not mean_len > 0 or max_len < mean_len:
        raise ValueError(f"decode steps need 0 < mean_len <= max_len, got mean_len={mean_len!r}, max_len={max_len!r}")
    n = np.asarray(seqs, dtype=float)
    c = np.maximum(np.asarray(concurrency, dtype=float), 1.0)
    steps = np.maximum(float(max_len), np.ceil(n * mean_len / c))
    return steps, n * mean_len / steps


def decode_overhead_times(steps, running, eng: EngineCosts, eff: EfficiencyTable, gpu=None) -> dict:
    """``{"decode_overhead": S·(a + b·r) / eff}`` seconds (``a = decode_step_s``, ``b = decode_seq_s``)."""
    base = np.asarray(steps, dtype=float) * (eng.decode_step_s + eng.decode_seq_s * np.asarray(running, dtype=float))
    return {"decode_overhead": base / eff.get("decode_overhead", gpu)}


def generate_call_times(eng: EngineCosts, eff: EfficiencyTable, gpu=None) -> dict:
    """``{"engine": generate_call_s / eff}`` seconds per generate call."""
    return {"engine": eng.generate_call_s / eff.get("engine", gpu)}


def layer_pass_times(layers, passes, eng: EngineCosts, eff: EfficiencyTable, gpu=None) -> dict:
    """``{"launch": layers·passes·layer_pass_s / eff}`` seconds of one micro-batch on one rank."""
    base = np.asarray(layers, dtype=float) * np.asarray(passes, dtype=float) * eng.layer_pass_s
    return {"launch": base / eff.get("launch", gpu)}


def step_overhead(eng: EngineCosts | None, eff: EfficiencyTable, gpu=None) -> float:
    """Fixed seconds per RL step, ``step_s / eff("framework")`` (0 without an engine)."""
    if eng is None or eng.step_s == 0:
        return 0.0
    return eng.step_s / eff.get("framework", gpu)


def padded_workload(w: WorkloadSpec, eng: EngineCosts | None) -> WorkloadSpec:
    """The workload training and inference passes compute on: with ``pad_to`` every sequence is
    ``pad_to`` tokens (prompt part ``pad_to - response_len``, at least 1), else ``w`` itself.

    Raises:
        ValueError: ``pad_to`` shorter than the mean sequence.
    """
    if eng is None or eng.pad_to is None:
        return w
    if eng.pad_to < w.seq_len:
        raise ValueError(f"engine field 'pad_to'={eng.pad_to} must be >= the mean sequence length "
                         f"prompt_len + response_len = {w.seq_len}")
    return replace(w, prompt_len=eng.pad_to - w.response_len)
