"""Host staging: ``Offload`` and ``Restore``, the primitives that move a model-stage through host memory.

Ours, not in the paper (its four primitives, §5.2, keep every state on GPUs). Two uses:

* :func:`stage`: a model-stage whose Split fits neither in place nor on free GPUs, two model-stages
  that would each wait for the other's GPUs, or a memory block with nothing left to drop
  (``estimate.plan_dag``) is copied to host memory, its GPUs are freed, and its target shards are
  written back from the host copy;
* :func:`unstage`: idle state kept in host memory (``Candidate.offload == "host"``) is written to its
  target layout on GPUs, or re-cut in host memory.

It is what RL frameworks already do every step when co-located models time-share GPUs through param
and optimizer offload (verl ``param_offload``/``optimizer_offload``, DeepSpeed ``adam_offload``;
reference/rl-frameworks.md); cutting target shards from a host copy is how DCP/UCP reshard a
checkpoint, and Gemini keeps in-memory checkpoints in host memory (reference/resharding.md §1.7).
Source: DESIGN.md §4.6, §4.8. The results are :class:`~nereus.transition.primitives.Primitive` values
with ``source = HOST``; their copies use :data:`HOST_ID` as the host side of ``pairs``, which the
cost model prices over each GPU's host link (``cost.ports``).
"""

from __future__ import annotations

from dataclasses import replace

from nereus.transition.emu import EMU, HOST_ID
from nereus.transition.primitives import Primitive

__all__ = ["stage", "unstage", "HOST", "HOST_ID"]

#: source of a :func:`stage`: host (CPU) memory of the nodes of the staged replica.
HOST = "host"
# HOST_ID (transition/emu.py) is the host side of staging ``pairs``: ``(gpu, HOST_ID, bytes)`` device →
# host, ``(HOST_ID, gpu, bytes)`` back.


def stage(current: tuple[EMU, ...], target: tuple[EMU, ...]) -> tuple[Primitive, Primitive]:
    """``Offload({E}) → E@host`` then ``Restore(E@host) → {E*}``: re-layout one model-stage through
    host memory (ours).

    For a Split that fits neither in place nor on free GPUs (the new, larger shards need room while
    the old ones are still live), two model-stages that would each wait for the other's GPUs, or a
    memory block with nothing left to drop (``estimate.plan_dag``):

    * **Offload** copies one current replica, ``current[0]``, to the host memory of its nodes
      (device → host, every GPU its own shard over its PCIe link) and frees every current EMU:
      ``mem_hi = 0``, ``mem_net = −old``; it releases the model-stage's GPUs (other model-stages
      may take them before the Restore);
    * **Restore** writes every target shard from host memory (host → device; the target layout's
      shards are cut from the host copy, as DCP/UCP reshard a checkpoint): ``mem_hi = mem_net =
      new``; it acquires the target GPUs.

    Between the two the model-stage's logical state lives only in host memory (``E@host``, an
    :class:`~nereus.transition.emu.EMU` with ``host=True``: no GPU bytes, no GPU ownership). It is
    what RL frameworks already do every step when co-located models time-share GPUs through param
    and optimizer offload (verl ``param_offload``/``optimizer_offload``, DeepSpeed
    ``adam_offload``; reference/rl-frameworks.md), and where Gemini keeps in-memory checkpoints
    (reference/resharding.md §1.7). Training state may be staged; losing that host meanwhile loses
    it, as with any single copy.

    Returns:
        ``(offload, restore)``; ``restore`` consumes what ``offload`` produces.

    Raises:
        ValueError: empty lists, or EMUs of more than one model-stage.
    """
    if not current or not target:
        raise ValueError(f"Stage needs current and target EMUs, got {len(current)} and {len(target)}")
    ms = current[0].model_stage
    for e in current + target:
        if e.model_stage != ms:
            raise ValueError(f"Stage of {ms}: EMU {e.uid} belongs to {e.model_stage}")
    src = current[0]
    staged = replace(src, uid=f"{ms}@host", host=True)
    old: dict[int, int] = {}
    new: dict[int, int] = {}
    for e in current:
        for g in e.gpus:
            old[g] = old.get(g, 0) + e.bytes_on(g)
    for e in target:
        for g in e.gpus:
            new[g] = new.get(g, 0) + e.bytes_on(g)
    out = tuple((g, HOST_ID, src.bytes_on(g)) for g in src.gpus)
    back = tuple((HOST_ID, g, b) for g, b in new.items())
    offload = Primitive(pid=f"offload:{ms}", kind="offload", model_stage=ms, consumes=tuple(e.uid for e in current),
                        produces=(staged,), gpus=tuple(old), mem_hi={g: 0 for g in old},
                        mem_net={g: -b for g, b in old.items()}, pairs=out, bytes_moved=sum(b for *_, b in out),
                        source=HOST)
    restore = Primitive(pid=f"restore:{ms}", kind="restore", model_stage=ms, consumes=(staged.uid,),
                        produces=tuple(target), gpus=tuple(new), acquires=tuple(new), mem_hi=dict(new),
                        mem_net=dict(new), pairs=back, bytes_moved=sum(new.values()), source=HOST, home=src.gpus)
    return offload, restore


def unstage(staged: tuple[EMU, ...], target: tuple[EMU, ...]) -> Primitive:
    """``Restore({E@host}) → {E*}``: write the target EMUs from host copies (ours).

    For a model-stage whose idle state is offloaded (``Candidate.offload == "host"``, so Φ gives
    host EMUs): the target shards are cut from the host copy ``staged[0]`` (as :func:`stage`'s
    Restore does) and every host EMU in ``staged`` is consumed.

    * target EMUs on GPUs (offload ``none``): host → device, ``mem_hi = mem_net = new`` on the
      target GPUs, which it acquires;
    * target host EMUs (offload ``host`` with another layout or GPU set): the host copy is re-cut
      into the target's layout in the host memory of the target GPUs' nodes; no GPU memory, no GPU
      acquired; each target GPU's share is a pair ``(HOST_ID, gpu, bytes)`` timed like a Restore
      (host memory bandwidth on the home nodes, ``min(host, NIC)`` to another node).

    Raises:
        ValueError: empty lists, EMUs of more than one model-stage, or a ``staged`` EMU that is not
            in host memory.
    """
    if not staged or not target:
        raise ValueError(f"Restore needs host and target EMUs, got {len(staged)} and {len(target)}")
    ms = staged[0].model_stage
    for e in staged + target:
        if e.model_stage != ms:
            raise ValueError(f"Restore of {ms}: EMU {e.uid} belongs to {e.model_stage}")
    if not all(e.host for e in staged):
        raise ValueError(f"Restore of {ms}: {[e.uid for e in staged if not e.host]} are not in host memory")
    new: dict[int, int] = {}
    for e in target:
        for g in e.gpus:
            new[g] = new.get(g, 0) + e.shard_on(g)
    on_gpu = {g: b for g, b in new.items() if not all(e.host for e in target if g in e.gpus)}
    back = tuple((HOST_ID, g, b) for g, b in new.items())
    return Primitive(pid=f"restore:{ms}", kind="restore", model_stage=ms, consumes=tuple(e.uid for e in staged),
                     produces=tuple(target), gpus=tuple(new), acquires=tuple(on_gpu), mem_hi=dict(on_gpu),
                     mem_net=dict(on_gpu), pairs=back, bytes_moved=sum(new.values()), source=HOST,
                     home=staged[0].gpus)
