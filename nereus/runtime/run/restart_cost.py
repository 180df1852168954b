"""What the controller's admission charges for a change the live executor cannot make (driver side).

Source: issue 24 item 2; DESIGN.md §4.9 (durable checkpoints). ``nereus run --adaptive`` executes a
change whose transition DAG the live executor cannot run (``transit/sharded.py``: ZeRO-1 slices
meeting ZeRO-2/3 slices in one primitive, or slices cut between TP/PP layouts otherwise than
``transit/regroup.py`` does) through the durable checkpoint instead: the run saves a checkpoint (a full copy is alive, so nothing is lost) and
restores it onto the target (``durable.restart``), which holds the unsliced logical state and so
loads into any ZeRO stage and layout. The admission must charge that path's cost, not the DAG's
``L_tran``:

``restart_s = save_s + load_s``, each from this run's measurements: the last restart's measured
seconds (``ev["seconds"]`` of a ``source == "checkpoint"`` event) stands for the load and rebuild,
the last completed checkpoint's blocking seconds for the save; before either was measured, the
DAG's own ``L_tran`` for each (the same bytes over the same links; a guess, said in the reason).
"""

from __future__ import annotations

from nereus.controller.decisions import TransitionCost

__all__ = ["restart_charge"]


def restart_charge(run, est, why: str) -> TransitionCost:
    """The admission cost of executing ``est``'s change by checkpoint restart (module docstring).

    Args:
        run: the :class:`~nereus.runtime.run.adaptive.AdaptiveRun` (its ``events`` and ``checkpoints``).
        est: the transition estimate the live executor cannot run.
        why: the executor's reason (``live_unsupported``).
    """
    loads = [e["seconds"] for e in run.events if e.get("source") == "checkpoint" and "seconds" in e]
    saves = [c["seconds"] for c in run.checkpoints if not c.get("background")]
    load = loads[-1] if loads else float(est.l_tran)
    save = saves[-1] if saves else float(est.l_tran)
    basis = ("measured" if loads and saves else "DAG L_tran for the unmeasured part")
    return TransitionCost(save + load, True, float(est.bytes_moved), "restart",
                          f"checkpoint restart ({basis}: save {save:.2f}s + load {load:.2f}s): {why}")
