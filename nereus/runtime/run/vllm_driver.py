"""The driver-side half of ``--rollout vllm``: start, report and stop the vLLM engines of a run.

:func:`start_vllm_engines` asks every worker of ``actor.generate``'s layout to start its replica's
engine (``WorkerCore.build_vllm``, collective per replica: TP rank 0 starts vLLM with the replica's TP
degree, then every rank pushes its shard of the initial weights into it). The per-step weight sync needs
nothing more from the driver: ``WorkerCore.sync_weights`` pushes into the engine after the rank-aligned
move (``worker/vllm_worker.py``). :func:`sync_summary` sums what a step's pushes moved.

Every exit path stops the engines: :func:`stop_vllm_engines` asks every live worker (not only the current
generation layout's: after a restart or a lost worker the layout may no longer name a worker that still
holds one) to close its engines; a failed start closes the ones that did start; SIGTERM to the driver
becomes ``SystemExit`` while engines run, so ``RLDriver.close`` runs in the ``finally`` blocks; a worker
process that dies anyway takes its engine down with it (its watchdog, ``worker/vllm_reaper.py``).
A live re-layout (:func:`begin_relayout`, :func:`finish_relayout`) restarts only the replicas that change,
starting the new ones beside the transition (:func:`prestart_vllm_engines`), or adopting the engines a
warm-up started steps earlier (``run/vllm_warm.py``; :func:`hidden_s` is what the start charge then leaves out).
"""

from __future__ import annotations

__all__ = ["GEN_STAGE", "vllm_legal", "replica_keys", "start_vllm_engines", "stop_vllm_engines", "sync_summary", "engine_logp_err",
           "step_metrics", "started", "rollout_tokens", "note_sync", "start_term", "begin_relayout",
           "finish_relayout", "prestart_vllm_engines",
           "stop_changed", "note_priced", "hidden_s", "drop_warm"]

#: the model-stage vLLM serves
GEN_STAGE = "actor.generate"


def vllm_legal(driver, plan):
    """``plan`` with ``actor.generate`` at PP 1 when the run generates with vLLM (its engines here run TP
    only): a PP > 1 generation candidate becomes TP·PP-way TP on the same workers if the model's heads
    allow it and the batch rules hold, else PP-fold more replicas, else PP 1 on its first ``tp·dp``
    workers. Unchanged for the built-in engine or PP 1 (the planner does not know vLLM's limit)."""
    from dataclasses import replace

    from nereus.runtime.model.sharding import validate_layout

    if driver.cfg.rollout != "vllm" or GEN_STAGE not in plan or plan[GEN_STAGE].pp == 1:
        return plan
    c = plan[GEN_STAGE]
    gpus = tuple(c.gpus) if c.gpus else tuple(range(c.num_gpus))
    cand = replace(c, pp=1, gpus=gpus[:c.tp * c.dp])
    for tp, dp in ((c.tp * c.pp, c.dp), (c.tp, c.dp * c.pp)):
        x = replace(c, tp=tp, pp=1, dp=dp, gpus=gpus)
        try:
            validate_layout(driver.spec, tp, 1)
            driver._check_batches(GEN_STAGE, "generate", x)
        except ValueError:
            continue
        cand = x
        break
    return replace(plan, candidates=tuple(cand if k.model_stage == GEN_STAGE else k for k in plan.candidates))


def replica_keys(layout) -> dict[tuple, int]:
    """``{(tp, replica workers, replica index): TP rank 0 worker}`` of a generation layout: two layouts'
    replicas with the same key have the same engine (its TP, workers and seed), so it can be kept."""
    return {(layout.tp, tuple(layout.replica(d)), d): layout.replica(d)[0] for d in range(layout.dp)}


def start_vllm_engines(driver, keep: frozenset = frozenset()) -> dict | None:
    """Start one vLLM engine per replica of ``actor.generate`` (options ``driver.cfg.vllm``) when the
    run's rollout engine is vLLM (``driver.cfg.rollout``); nothing otherwise. Replicas whose key
    (:func:`replica_keys`) is in ``keep`` still hold their engine: they only get the weights pushed.
    A start that fails closes every engine of the run before the error propagates.

    Returns:
        ``{"start_s": [engine start seconds per started replica], "waited_s": [seconds each waited for
        its start: less than start_s for one prestarted off the critical path], "prestarted": [bool],
        "kv": [each started replica's KV report], "push": [the first weight push, per worker], "kept":
        [kept replicas' indices]}`` (also kept as ``driver.vllm_info``); None for the built-in engine.
    """
    if driver.cfg.rollout != "vllm":
        return None
    lay = driver.layouts[GEN_STAGE]
    opts = dict(driver.cfg.vllm or {})
    keys = replica_keys(lay)
    kept_workers = {w for k in keys if k in keep for w in k[1]}
    # each start's engines get a tag of their own: their push counters and hand-off keys start afresh
    driver.vllm_starts = n = getattr(driver, "vllm_starts", 0) + 1
    tag = driver.tag if n == 1 else f"{driver.tag}.{n}"
    calls = [driver.workers[w].vllm_push.remote(GEN_STAGE) if w in kept_workers
             else driver.workers[w].build_vllm.remote(GEN_STAGE, tag, opts) for w in lay.workers]
    _guard_sigterm(driver)
    try:
        res = driver._get(calls, "starting vLLM engines", timeout=max(4 * driver.cfg.timeout_s, 1800))
    except BaseException:
        stop_vllm_engines(driver, everything=True)
        raise
    lead = [r for w, r in zip(lay.workers, res) if lay.position(w)[2] == 0 and w not in kept_workers]
    info = {"start_s": [r["start_s"] for r in lead], "waited_s": [r.get("waited_s", r["start_s"]) for r in lead],
            "prestarted": [bool(r.get("prestarted")) for r in lead], "kv": [r["kv"] for r in lead],
            "push": [r if w in kept_workers else r["push"] for w, r in zip(lay.workers, res)],
            "kept": sorted(k[2] for k in keys if k in keep)}
    driver.vllm_info = info
    return info


def stop_vllm_engines(driver, keep: frozenset = frozenset(), everything: bool = False) -> None:
    """Shut the vLLM engines of a ``--rollout vllm`` run down on every live worker (a lost worker's
    engine died with it, through its watchdog), except those of the replicas whose key
    (:func:`replica_keys` of the current layout) is in ``keep``; ``everything``: prestarted engines too,
    and the driver's SIGTERM handler is restored (the run's teardown). Nothing for other runs."""
    from nereus.runtime.worker.failures import WorkerFailure

    if driver.cfg.rollout != "vllm" or not driver.workers:
        return
    kept = set()
    if keep and GEN_STAGE in getattr(driver, "layouts", {}):
        kept = {w for k in replica_keys(driver.layouts[GEN_STAGE]) if k in keep for w in k[1]}
    calls = [w.close_all_vllm.remote() if everything else w.close_vllm.remote(GEN_STAGE)
             for i, w in enumerate(driver.workers) if w is not None and i not in kept]
    try:
        driver._get(calls, "stopping vLLM engines", timeout=120)
    except WorkerFailure:
        pass
    finally:
        if everything:
            _restore_sigterm(driver)


def _guard_sigterm(driver) -> None:
    """While engines run, SIGTERM to the driver raises ``SystemExit(143)`` (so ``finally`` blocks close
    them) instead of ending the process at once; only from the main thread, over the default handler."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or getattr(driver, "_vllm_sigterm", None):
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def _exit(signum, frame):
        raise SystemExit(128 + signum)

    driver._vllm_sigterm = signal.SIG_DFL
    signal.signal(signal.SIGTERM, _exit)


def _restore_sigterm(driver) -> None:
    import signal
    import threading

    old = getattr(driver, "_vllm_sigterm", None)
    if old is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, old)
        driver._vllm_sigterm = None


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
def _layout(c):
    """The runtime ``Layout`` of a plan's candidate (its workers, or the first ``tp·pp·dp``)."""
    from nereus.runtime.comm.parallel import Layout

    gpus = tuple(c.gpus) if c.gpus else tuple(range(c.tp * c.pp * c.dp))
    return Layout(c.tp, c.pp, c.dp, gpus)


def _new_replicas(current, target) -> list[tuple]:
    """The replica keys (:func:`replica_keys`) of ``target``'s ``actor.generate`` that ``current`` lacks:
    the engines a change must start (empty: every target replica's engine exists and is kept)."""
    old = replica_keys(_layout(current[GEN_STAGE]))
    return [k for k in replica_keys(_layout(target[GEN_STAGE])) if k not in old]


def _gen_changes(current, target) -> bool:
    """Whether ``actor.generate``'s change needs an engine started (a replica of new TP, workers or index)."""
    return bool(_new_replicas(current, target))


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


def start_term(run, current, target, overlap_s: float = 0.0) -> float:
    """Predicted seconds the vLLM engine start adds to ``L_tran`` of ``current → target``: the calibrated
    start less ``overlap_s`` (seconds of the transition the start runs beside: :func:`begin_relayout`
    starts the new engines before the state moves) and less what of each new replica's start is already
    behind the run (:func:`hidden_s`: a warm engine, ``run/vllm_warm.py``), the slowest replica's; 0 for
    the built-in engine or when every target replica keeps its engine. The controller's payback sees it
    (the target and its term are recorded for the warm-up: :func:`note_priced`)."""
    from nereus.transition.engine_start import engine_start_term

    if run.driver.cfg.rollout != "vllm" or GEN_STAGE not in current or GEN_STAGE not in target:
        return 0.0
    legal = run._legal(run.driver, target) if hasattr(run, "_legal") else target
    new = _new_replicas(current, legal)
    m, b = _start_model(run), _rank_bytes(run.driver, legal[GEN_STAGE].tp)
    term = max((engine_start_term(m, True, b, overlap_s + min(hidden_s(run.driver, k), 1e18)) for k in new),
               default=0.0)
    note_priced(run, target, term)
    return term


def note_priced(run, target, term_s: float) -> None:
    """Record a target the controller priced and the engine start its ``L_tran`` carried (seconds), while
    the run collects them (``run._vllm_priced``, ``run/vllm_warm.py``)."""
    lst = getattr(run, "_vllm_priced", None)
    if lst is not None:
        lst.append((target, float(term_s)))


def hidden_s(driver, key: tuple) -> float:
    """Seconds of replica ``key``'s engine start already behind the run (``driver.vllm_warm``,
    ``run/vllm_warm.py``): ``inf`` when its warm engine is up, the seconds since its start began while
    it warms, 0 when none warms."""
    import time

    k = (getattr(driver, "vllm_warm", None) or {}).get("keys", {}).get(key)
    if k is None:
        return 0.0
    return float("inf") if k.get("done") else time.perf_counter() - k["t0"]


def drop_warm(driver, keep: list) -> None:
    """Before a re-layout: close the warm engines (``driver.vllm_warm``) whose replica is not in ``keep``
    (the target's new replicas) and forget the warm-up."""
    w = getattr(driver, "vllm_warm", None)
    driver.vllm_warm = None
    drop = [k for k in (w or {}).get("keys", {}) if k not in keep and driver.workers[k[1][0]] is not None]
    if drop:
        driver._get([driver.workers[k[1][0]].drop_vllm_prestart.remote(GEN_STAGE) for k in drop],
                    "dropping warm vLLM engines")


def stop_changed(driver, current, target) -> frozenset:
    """Stop the engines of ``current``'s generation replicas that ``target`` does not keep (same TP,
    workers and replica index; ``driver.layouts`` must be ``current``'s); returns the kept replica keys,
    for :func:`start_vllm_engines` after the change (the recovery from lost workers and the live
    re-layout use it). Empty, and nothing stopped, for the built-in engine."""
    if driver.cfg.rollout != "vllm" or GEN_STAGE not in current or GEN_STAGE not in target:
        return frozenset()
    keep = frozenset(replica_keys(_layout(current[GEN_STAGE]))) & frozenset(replica_keys(_layout(target[GEN_STAGE])))
    stop_vllm_engines(driver, keep=keep)
    return keep


def prestart_vllm_engines(driver, target, dry: bool = False, only: list | None = None) -> list[tuple]:
    """Start, in the background (``WorkerCore.prestart_vllm``), the engines of ``target``'s generation
    replicas that the current layout lacks (``only``: those of them), on their TP rank 0 workers, while
    the current engines keep serving; :func:`start_vllm_engines` after the change adopts them. Returns the
    replica keys started (``dry``: the keys, nothing started)."""
    if driver.cfg.rollout != "vllm":
        return []
    current = {GEN_STAGE: driver.cands[GEN_STAGE]}
    new = [k for k in _new_replicas(current, target) if only is None or k in only]
    if dry:
        return new
    opts = dict(driver.cfg.vllm or {})
    driver._get([driver.workers[k[1][0]].prestart_vllm.remote(GEN_STAGE, driver.spec, k[0], k[2], driver.cfg.precision,
                                                              opts) for k in new], "prestarting vLLM engines")
    return new


def begin_relayout(run, current, target, prestart: bool = True) -> dict | None:
    """Before a live transition of ``current → target``: stop the vLLM engines of replicas that change
    (those kept, same TP, workers and index, keep serving) and, with ``prestart``, start the new
    replicas' engines in the background so their start runs beside the transition's state moves.
    Returns the state :func:`finish_relayout` needs, None when no engine starts."""
    d = run.driver
    if d.cfg.rollout != "vllm" or GEN_STAGE not in current or not _gen_changes(current, target):
        return None
    import time

    term = start_term(run, current, target)  # less what a warm-up already hid (before drop_warm forgets it)
    full = _start_model(run).predict(_rank_bytes(d, target[GEN_STAGE].tp))
    keep = stop_changed(d, current, target)
    drop_warm(d, _new_replicas(current, target))  # warm engines of another target close (run/vllm_warm.py)
    t0 = time.perf_counter()
    new = prestart_vllm_engines(d, target) if prestart else []
    return {"term_s": term, "full_s": full, "keep": keep, "prestarted": new, "t0": t0}


def finish_relayout(run, state: dict, report) -> dict:
    """After a live transition: start (or adopt the prestarted) engines of the target layout's new
    replicas, push the rebuilt generation engine's weights into every engine, calibrate the start
    model and log predicted vs measured ``L_tran`` with the engine start.

    Returns ``{"predicted_start_s", "charged_start_s", "measured_start_s", "waited_s", "hidden_s",
    "start_wall_s", "predicted_l_tran", "measured_l_tran", "kept", "prestarted"}``: ``predicted_start_s``
    is the start model's whole start, ``charged_start_s`` what ``L_tran`` charged of it (less what a
    warm-up hid, ``run/vllm_warm.py``); ``predicted_l_tran`` is the DAG's makespan plus the charged start
    not hidden behind it (``max(0, charged − DAG)`` when prestarted, else the charged start); ``hidden_s``
    the measured start less what the driver waited for it."""
    import time

    d = run.driver
    t0 = time.perf_counter()
    info = start_vllm_engines(d, keep=state["keep"])
    wall = time.perf_counter() - t0
    measured = max(info["start_s"]) if info["start_s"] else 0.0
    waited = max(info["waited_s"]) if info["waited_s"] else 0.0
    if measured > 0:
        _start_model(run).observe(_rank_bytes(d, d.layouts[GEN_STAGE].tp), measured)
    dag = float(report.predicted_l_tran)
    charged = max(0.0, state["term_s"] - dag) if state["prestarted"] else state["term_s"]
    out = {"predicted_start_s": state["full_s"], "charged_start_s": state["term_s"], "measured_start_s": measured,
           "waited_s": waited,
           "hidden_s": max(0.0, measured - waited), "start_wall_s": wall, "kept": info["kept"],
           "prestarted": any(info["prestarted"]), "predicted_l_tran": dag + charged,
           "measured_l_tran": float(report.measured_l_tran) + wall}
    run.log(f"  vLLM engines in the new layout: {len(info['start_s'])} started"
            f"{' (prestarted beside the transition)' if out['prestarted'] else ''}, replicas {info['kept']} kept; "
            f"engine start predicted {state['full_s']:.1f}s (charged {state['term_s']:.1f}s), measured "
            f"{measured:.1f}s, of which hidden "
            f"{out['hidden_s']:.1f}s ({wall:.1f}s waited with the weight push); L_tran with the engine start: "
            f"predicted {out['predicted_l_tran']:.2f}s, measured {out['measured_l_tran']:.2f}s")
    return out
