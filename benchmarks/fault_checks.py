"""The fault benchmark's checkpoint check (``benchmarks/bench_faults.py``; issue 30's "no checkpoint lost").

A run's durable checkpoint is lost when the last one it completed (``AdaptiveRun.checkpoints``, whose
step is ``ckpt_step``) is no longer what ``<checkpoint_dir>/current`` holds, or no longer passes the
checks ``--resume`` makes (``durable/integrity.py``: manifest sizes and SHA-256s, job identity, step
against the shards' counters): a save that deleted or overwrote it, a failed run that removed its
temporary directory (the only copy of the state), an interrupted swap. :func:`checkpoint_problem`
says which, for a run that completed (checked in its ``on_end``, before the temporary directory is
removed) and for one that ended with an error (checked after it ended: the run keeps the directory
then). A restore that went back past the last complete checkpoint lost it too:
:func:`restores_past_checkpoint` counts those among a run's recoveries.
"""

from __future__ import annotations

from nereus.runtime.durable import store
from nereus.runtime.durable.integrity import CheckpointRefused, verify_checkpoint

__all__ = ["checkpoint_problem", "restores_past_checkpoint"]


def checkpoint_problem(run, identity: dict) -> str | None:
    """None when ``run``'s last completed checkpoint is current and passes ``--resume``'s checks, else
    one line saying what is wrong.

    Args:
        run: an :class:`~nereus.runtime.run.adaptive.AdaptiveRun` after (or at the end of) its run: its
            ``ckpt_dir``, ``checkpoints`` (every completed one) and ``ckpt_step``.
        identity: ``integrity.job_identity(spec, workload)`` of the run's job.
    """
    if not run.checkpoints:
        return "no checkpoint was completed"
    if not run.ckpt_dir:
        return "the run has no checkpoint directory"
    path = store.current_dir(run.ckpt_dir)
    try:
        meta = verify_checkpoint(path, identity)
    except (CheckpointRefused, OSError) as e:
        return f"the checkpoint of step {run.ckpt_step} is not usable: {str(e)[:300]}"
    if int(meta["step_index"]) != run.ckpt_step:
        return f"current holds step {meta['step_index']}, the last checkpoint completed was step {run.ckpt_step}"
    return None


def restores_past_checkpoint(recoveries: list[dict]) -> int:
    """Recoveries from the durable checkpoint that went back further than the last complete one: more
    steps lost than ``since_checkpoint`` (the steps between it and the boundary, ``FaultBenchRun``)."""
    return sum(1 for ev in recoveries if ev.get("source") == "checkpoint"
               and ev.get("steps_lost", 0) > ev.get("since_checkpoint", 0))
