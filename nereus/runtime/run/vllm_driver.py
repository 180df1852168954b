"""The driver-side half of ``--rollout vllm``: start, report and stop the vLLM engines of a run.

:func:`start_vllm_engines` asks every worker of ``actor.generate``'s layout to start its replica's
engine (``WorkerCore.build_vllm``, collective per replica: TP rank 0 starts vLLM with the replica's TP
degree, then every rank pushes its shard of the initial weights into it). The per-step weight sync needs
nothing more from the driver: ``WorkerCore.sync_weights`` pushes into the engine after the rank-aligned
move (``worker/vllm_worker.py``). :func:`sync_summary` sums what a step's pushes moved.
"""

from __future__ import annotations

__all__ = ["GEN_STAGE", "start_vllm_engines", "stop_vllm_engines", "sync_summary", "engine_logp_err",
           "step_metrics", "started", "rollout_tokens", "note_sync", "start_term", "begin_relayout",
           "finish_relayout"]

#: the model-stage vLLM serves
GEN_STAGE = "actor.generate"


def start_vllm_engines(driver) -> dict | None:
    """Start one vLLM engine per replica of ``actor.generate`` (options ``driver.cfg.vllm``) when the
    run's rollout engine is vLLM (``driver.cfg.rollout``); nothing otherwise.

    Returns:
        ``{"start_s": [engine start seconds per replica], "kv": [each replica's KV report],
        "push": [the first weight push, per worker]}`` (also kept as ``driver.vllm_info``); None for the
        built-in engine.
    """
    if driver.cfg.rollout != "vllm":
        return None
    lay = driver.layouts[GEN_STAGE]
    opts = dict(driver.cfg.vllm or {})
    res = driver._get([driver.workers[w].build_vllm.remote(GEN_STAGE, driver.tag, opts) for w in lay.workers],
                      "starting vLLM engines", timeout=max(4 * driver.cfg.timeout_s, 1800))
    lead = [r for w, r in zip(lay.workers, res) if lay.position(w)[2] == 0]
    info = {"start_s": [r["start_s"] for r in lead], "kv": [r["kv"] for r in lead],
            "push": [r["push"] for r in res]}
    driver.vllm_info = info
    return info


def stop_vllm_engines(driver) -> None:
    """Shut every vLLM engine of a ``--rollout vllm`` run down (before its workers' engines are dropped);
    a lost worker's engine died with it. Nothing for other runs."""
    from nereus.runtime.worker.failures import WorkerFailure

    if driver.cfg.rollout != "vllm" or not driver.workers or GEN_STAGE not in getattr(driver, "layouts", {}):
        return
    try:
        driver._get([driver.workers[w].close_vllm.remote(GEN_STAGE) for w in driver.layouts[GEN_STAGE].workers
                     if driver.workers[w] is not None], "stopping vLLM engines", timeout=120)
    except WorkerFailure:
        pass


def sync_summary(results: list[dict]) -> dict:
    """Bytes and seconds of one weight sync's pushes into vLLM, from ``sync_weights``' results:
    ``{"vllm_sync_bytes": bytes the engine ranks read, "vllm_sync_s": the slowest rank's write + barrier
    + load seconds}`` (empty when no engine was pushed to)."""
    pushes = [r["vllm"] for r in results if isinstance(r, dict) and "vllm" in r]
    if not pushes:
        return {}
    return {"vllm_sync_bytes": float(sum(p["read"] for p in pushes)),
            "vllm_sync_s": max(p["write_s"] + p["barrier_s"] + p["load_s"] for p in pushes)}


def engine_logp_err(rollout_logp, old_logp, mask) -> float:
    """Largest ``|log p_engine − log p_infer|`` over the response tokens: vLLM's log-probs of the tokens
    it sampled against ``actor.infer``'s of the same tokens, both of the policy just synced. Near 0 (fp32:
    ~1e-5) when the engine holds the trained weights."""
    return float(((rollout_logp - old_logp).abs() * mask).max())


def started(driver):
    """:func:`start_vllm_engines`, then ``driver`` (``RLDriver.build_engines``' return)."""
    start_vllm_engines(driver)
    return driver


def rollout_tokens(driver, out: list, greedy: bool):
    """Responses ``[B, R]`` from the replicas' answers; a vLLM replica answers ``(responses, log-probs)``:
    the log-probs of a sampled (not greedy) generation are kept as ``driver.rollout_logp`` (None for
    the built-in engine)."""
    import torch

    if not greedy:
        driver.rollout_logp = torch.cat([o[1] for o in out]) if isinstance(out[0], tuple) else None
    return torch.cat([o[0] if isinstance(o, tuple) else o for o in out])


def note_sync(driver, results: list) -> dict:
    """Keep a weight sync's vLLM summary (:func:`sync_summary`) as ``driver.last_vllm_sync``; returns
    ``driver.last_sync`` (``RLDriver._sync``' return)."""
    driver.last_vllm_sync = sync_summary(results)
    return driver.last_sync


def step_metrics(driver, batch: dict, _sync=None) -> dict:
    """A step's vLLM metrics: ``engine_logp_err`` (:func:`engine_logp_err` of the sampled rollouts) and
    the weight sync's :func:`sync_summary`; empty for the built-in engine. ``_sync``: the step's weight
    sync result (passed so the sync runs before these are read)."""
    out = dict(getattr(driver, "last_vllm_sync", None) or {})
    lp = getattr(driver, "rollout_logp", None)
    if lp is not None:
        out["engine_logp_err"] = engine_logp_err(lp, batch["old_logp"], batch["mask"])
    return out


# ---------------------------------------------------------------------- live re-layout (run/adaptive.py)
def _gen_changes(current, target) -> bool:
    """Whether ``actor.generate``'s layout or workers differ between two plans."""
    a, b = current[GEN_STAGE], target[GEN_STAGE]
    return (a.tp, a.pp, a.dp, tuple(a.gpus)) != (b.tp, b.pp, b.dp, tuple(b.gpus))


def _rank_bytes(driver, tp: int) -> float:
    """Weight bytes per engine rank of ``actor.generate`` at TP ``tp`` (fp32 or bf16 weights)."""
    from nereus.runtime.model.sharding import param_shapes

    n = sum(int(__import__("math").prod(s)) for s, _ in param_shapes(driver.spec).values())
    return n * (2 if driver.cfg.precision == "bf16" else 4) / tp


def _start_model(run):
    """The run's calibrated :class:`~nereus.transition.engine_start.EngineStartModel` (made on first use,
    fitted to the run's first engine starts)."""
    from nereus.transition.engine_start import EngineStartModel

    m = getattr(run, "engine_start", None)
    if m is None:
        m = run.engine_start = EngineStartModel()
        info = getattr(run.driver, "vllm_info", None)
        if info and info["start_s"]:
            m.observe(_rank_bytes(run.driver, run.driver.layouts[GEN_STAGE].tp), max(info["start_s"]))
    return m


def start_term(run, current, target) -> float:
    """Predicted seconds the vLLM engine start adds to ``L_tran`` of ``current → target`` (0 for the
    built-in engine or an unchanged generation layout); the controller's payback sees it."""
    from nereus.transition.engine_start import engine_start_term

    if run.driver.cfg.rollout != "vllm" or GEN_STAGE not in current or GEN_STAGE not in target:
        return 0.0
    return engine_start_term(_start_model(run), _gen_changes(current, target),
                             _rank_bytes(run.driver, target[GEN_STAGE].tp))


def begin_relayout(run, current, target) -> float | None:
    """Before a live transition: stop the old vLLM engines when the generation layout changes (the
    runtime engine they were fed from becomes a unit). Returns the predicted start term, None when no
    engine restarts."""
    term = start_term(run, current, target)
    if run.driver.cfg.rollout != "vllm" or not _gen_changes(current, target):
        return None
    stop_vllm_engines(run.driver)
    return term


def finish_relayout(run, predicted_start_s: float, report) -> dict:
    """After a live transition: start the target layout's engines (weights pushed from the rebuilt
    generation engine), calibrate the start model and log predicted vs measured ``L_tran`` with the
    engine start. Returns ``{"predicted_start_s", "measured_start_s", "predicted_l_tran", "measured_l_tran"}``."""
    import time

    d = run.driver
    t0 = time.perf_counter()
    info = start_vllm_engines(d)
    wall = time.perf_counter() - t0
    measured = max(info["start_s"])
    _start_model(run).observe(_rank_bytes(d, d.layouts[GEN_STAGE].tp), measured)
    out = {"predicted_start_s": predicted_start_s, "measured_start_s": measured, "start_wall_s": wall,
           "predicted_l_tran": float(report.predicted_l_tran) + predicted_start_s,
           "measured_l_tran": float(report.measured_l_tran) + wall}
    run.log(f"  vLLM engines restarted in the new layout: engine start predicted {predicted_start_s:.1f}s, "
            f"measured {measured:.1f}s ({len(info['start_s'])} engine(s), {wall:.1f}s with the first weight push); "
            f"L_tran with the engine start: predicted {out['predicted_l_tran']:.2f}s, measured "
            f"{out['measured_l_tran']:.2f}s")
    return out
