"""Warming a rejected target's vLLM engines, so that the controller's payback can admit it once they are up.

A generation re-layout on vLLM pays the start of the target's new engines (``transition/engine_start.py``):
tens of seconds here (30-130 s on this shared 2-core machine), minutes at 70B. Against a saving of a
fraction of a second per step, the payback rule (``controller/admission.py``) rejects such a target
whenever that start is on the critical path. But an engine start needs only the model's shapes, the TP
degree and the replica index (``WorkerCore.prestart_vllm``), so it can run in the background while the
current plan keeps training and generating. This module does that in an adaptive ``--rollout vllm`` run:

1. when nothing warms yet and the controller keeps its plan because a faster target does not pay back (a ``Keep`` whose reason
   is the payback rule) and that target's transition cost carried an engine start, the new replicas'
   engines of that target (``run/vllm_driver.py`` ``replica_keys``, on their TP rank 0 workers) are
   started in the background (:func:`warm`); a worker may then hold the engine that serves now and
   the one that is warming;
2. while they warm, the transition cost of a target charges each warming replica only
   ``max(0, T_start − elapsed)`` (``vllm_driver.hidden_s``; 0 once its start is done), and nothing is charged
   for a replica whose engine is up;
3. at the first boundary after every warming engine is up, the run asks the controller to revisit
   (``Controller.revisit``): it replans with ``H`` the steps since the pool last changed, and its payback
   rule, now without the start, decides; an admitted target adopts the warm engines
   (``begin_relayout``/``finish_relayout``), which log the start as hidden.

A warm engine whose target is not taken stays until a later change drops it (``begin_relayout``, ``vllm_driver.drop_warm``) or the
run ends (``close_all_vllm``). On GPUs the warming engine needs memory beside the serving one
(``gpu_memory_utilization`` of both); that case is not tried here.
"""

from __future__ import annotations

import time

from nereus.controller.controller import Controller
from nereus.controller.decisions import Keep
from nereus.runtime.run.vllm_driver import GEN_STAGE, prestart_vllm_engines

__all__ = ["WarmingController", "make_controller", "warm", "poll"]


class WarmingController(Controller):
    """The run's :class:`Controller` that warms rejected targets' engines (module docstring); the run is
    ``run`` (an ``AdaptiveRun``: its driver, ``_legal`` and ``log``)."""

    def __init__(self, run, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.run = run

    def observe(self, report):
        """``Controller.observe`` with the warm-up around it: a revisit is asked for first when every
        warming engine is up (:func:`poll`), and a payback rejection of a target with an engine start
        warms that target's engines after (:func:`warm`)."""
        if poll(self.run):
            self.revisit(report.step)
        self.run._vllm_priced = []
        dec = super().observe(report)
        if isinstance(dec, Keep) and "payback" in dec.reason:
            priced = [(t, s) for t, s in getattr(self.run, "_vllm_priced", []) if s > 0]
            if priced:
                warm(self.run, min(priced, key=lambda x: x[0].l_step)[0])
        return dec


def make_controller(run, *args, **kw) -> Controller:
    """A :class:`WarmingController` for a ``--rollout vllm`` run, a plain :class:`Controller` otherwise."""
    if run.cfg.rollout == "vllm":
        return WarmingController(run, *args, **kw)
    return Controller(*args, **kw)


def warm(run, target) -> list:
    """Start in the background the engines of ``target``'s (legalised) generation replicas that the
    current layout lacks, unless engines warm already (one warm-up at a time); returns the keys started."""
    d = run.driver
    legal = run._legal(d, target) if hasattr(run, "_legal") else target
    w = d.vllm_warm = getattr(d, "vllm_warm", None) or {"keys": {}, "asked": False}
    t0 = time.perf_counter()
    new = [k for k in prestart_vllm_engines(d, legal, dry=True) if k not in w["keys"]]
    if not new or w["keys"]:  # one warm-up at a time: a second would replace (and wait for) the first
        return []
    prestart_vllm_engines(d, legal, only=new)
    for k in new:
        w["keys"][k] = {"t0": t0, "done": False}
    w["asked"] = False
    run.log(f"  vLLM: warming the rejected target's engines in the background: replicas "
            f"{[(k[0], k[1]) for k in new]} (TP, workers)")
    return new


def poll(run) -> bool:
    """Update the warming engines' state from their workers; True once, at the first boundary where every
    one is up (the run then asks the controller to revisit). A start that failed is dropped and logged."""
    d = run.driver
    w = getattr(d, "vllm_warm", None)
    if not w or not w["keys"]:
        return False
    for k in [k for k in w["keys"] if d.workers[k[1][0]] is None]:  # its worker was lost or left
        w["keys"].pop(k)
    pending = [k for k, v in w["keys"].items() if not v["done"]]
    st = d._get([d.workers[k[1][0]].vllm_prestart_status.remote(GEN_STAGE) for k in pending], "vLLM warm-up status")
    for k, s in zip(pending, st):
        if s["key"] != (k[0], k[2]) or s["error"]:
            run.log(f"  vLLM: warm engine of replica {k[:2]} lost ({s['error'] or 'replaced'}); not warm")
            w["keys"].pop(k)
        elif s["done"]:
            w["keys"][k].update(done=True, start_s=s["elapsed_s"])
    if w["keys"] and all(v["done"] for v in w["keys"].values()) and not w["asked"]:
        w["asked"] = True
        run.log(f"  vLLM: warm engines up (started in {max(v['start_s'] for v in w['keys'].values()):.1f}s, "
                f"beside the steps); the controller revisits the rejected target")
        return True
    return False
