"""The live-transition executor: runs a transition DAG on the workers that hold the state.

Source: DESIGN.md §4.8 (transition execution), paper §5.2 and §6.3.

The DAG and its schedule come from ``nereus.transition`` as data (``estimate_transition``). The
executor

1. checks them before anything moves (:func:`~nereus.transition.verify.verify_schedule`: DAG order,
   last-copy rule, memory bound, ownership, target reached) and that every worker it needs is in
   the pool; a :class:`~nereus.transition.verify.ScheduleError` or ``ValueError`` leaves every
   engine as it was;
2. turns the engines of every model-stage that changes into units (``WorkerCore.transition_begin``);
3. submits each primitive, in the schedule's start order, to every worker it touches as one
   :class:`~nereus.runtime.transit.plans.MoveSpec` (metadata). Each Ray actor runs its calls in submission
   order, and a call also waits (Ray dependencies) for DAG predecessors that share no worker with
   it, so primitives on disjoint workers run concurrently while the DAG's order holds;
4. builds each changed model-stage's engine in its target layout from the units
   (``transition_finish``) and checks that no unit is left over.

The driver sends MoveSpecs and receives per-worker statistics only: no parameter, gradient or
optimizer tensor passes through it (:attr:`TransitionReport.driver_bytes` counts what it received).
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass, field

from nereus.runtime.comm.parallel import Layout
from nereus.runtime.model.precision import TRAIN_KINDS, WEIGHT_KINDS
from nereus.runtime.transit.plans import MoveSpec, UnitMeta
from nereus.runtime.transit.sharded import aligned_target, dropped_targets, live_unsupported, rebuild_dropped
from nereus.runtime.worker.failures import WorkerFailure
from nereus.spec.plan import Plan
from nereus.transition.copy_cost import copy_workers, fresh_bytes, fresh_recv_bytes
from nereus.transition.cost import copy_bytes
from nereus.transition.estimate import TransitionEstimate
from nereus.transition.primitives import STORAGE
from nereus.transition.verify import verify_schedule

__all__ = ["TransitionExecutor", "TransitionReport", "PrimitiveRecord", "move_specs"]


@dataclass
class PrimitiveRecord:
    """What one primitive did: predicted and measured seconds, bytes per worker.

    Attributes:
        pid, kind, model_stage: the primitive.
        predicted_s: ``cost.duration`` of it.
        measured_s: from its first worker's start to its last worker's end (wall seconds).
        setup_s: the slowest worker's communicator setup, seconds.
        transfer_s: the slowest worker's send/receive time, seconds.
        copy_s: the slowest worker's packing plus assembly time, seconds (``transit/packing.py``).
        predicted_bytes: the planner's ``bytes_moved``.
        bytes_received: state bytes that arrived at its workers over links, from host memory
            (Restore) or storage (Load), summed; headers excluded.
        sent, received: worker → state bytes.
        header_bytes: counters headers sent (40 B per buffer).
        copy_bytes: the planner's copy bytes of it (``cost.copy_bytes``), what ``copy_s`` is
            calibrated against; pack_workers, assemble_workers: how many workers pack and how
            many assemble (``copy_cost.copy_workers``); fresh_recv_bytes: the busiest receiver's
            bytes in freshly mapped receive buffers (``copy_cost.fresh_recv_bytes``).
        preds, worker_ids: its DAG predecessors' pids and the workers that ran it (the dispatch
            latency's calibration, ``transition/calibrate.py``).
        pack_s, assemble_s: the slowest worker's packing, and the slowest worker's assembly,
            seconds (their sum is the copy on its critical path, ``cost.copy_bytes``).
        t_start, t_ready, t_end: its first worker's start, last worker's start and last worker's
            end, seconds from the transition's first primitive start (the calibration's span and
            core-sharing correction, ``transition/calibrate.py``).
        workers: how many worker processes ran a part of it.
        pack_bytes, assemble_bytes: the planner's largest send bytes and largest new-shard bytes
            of one worker (the two parts of ``copy_bytes``); pack_strided, assemble_strided: the
            column-slice bytes among them; fresh_bytes: the send-buffer bytes in freshly mapped
            buffers (``transition/copy_cost.py``): what ``pack_s`` and ``assemble_s`` are
            calibrated against.
        freed_tensors: a Destroy's most tensors one worker freed (the teardown's calibration,
            ``transition/teardown.py``).
        fault_s_per_byte: worker → seconds per byte that first touching a fresh CPU buffer adds in
            that worker's process (``transit/fault_probe.py``; the prior of ``φ``,
            ``calibrate.fit_copy``); empty on GPUs.
        pack_faults, transfer_faults: the most minor page faults one worker took while packing and
            while sending and receiving (about bytes / 4096 for a freshly mapped buffer).
    """

    pid: str
    kind: str
    model_stage: str
    predicted_s: float
    measured_s: float
    setup_s: float
    transfer_s: float
    predicted_bytes: int
    bytes_received: int
    sent: dict = field(default_factory=dict)
    received: dict = field(default_factory=dict)
    header_bytes: int = 0
    copy_s: float = 0.0
    copy_bytes: int = 0
    pack_s: float = 0.0
    assemble_s: float = 0.0
    t_start: float = 0.0
    t_ready: float = 0.0
    t_end: float = 0.0
    workers: int = 0
    pack_bytes: int = 0
    assemble_bytes: int = 0
    pack_strided: int = 0
    assemble_strided: int = 0
    fresh_bytes: int = 0
    pack_workers: int = 0
    assemble_workers: int = 0
    fresh_recv_bytes: int = 0
    preds: list = field(default_factory=list)
    worker_ids: list = field(default_factory=list)
    freed_tensors: int = 0
    fault_s_per_byte: dict = field(default_factory=dict)
    pack_faults: int = 0
    transfer_faults: int = 0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class TransitionReport:
    """One executed transition.

    Attributes:
        primitives: records in execution order.
        predicted_l_tran: the schedule's makespan, seconds.
        measured_l_tran: wall seconds of the primitives (first start to last end).
        seconds: wall seconds of the whole call (checks, engine hand-over and rebuild included).
        predicted_bytes, bytes_moved: the DAG's and the executor's state bytes.
        min_bytes: bytes any transition between the two plans must move.
        driver_bytes: bytes the driver received from workers during the transition (pickled
            metadata; no tensor).
    """

    primitives: list
    predicted_l_tran: float
    measured_l_tran: float
    seconds: float
    predicted_bytes: int
    bytes_moved: int
    min_bytes: int
    driver_bytes: int

    def summary(self) -> str:
        kinds: dict[str, int] = {}
        for r in self.primitives:
            kinds[r.kind] = kinds.get(r.kind, 0) + 1
        return (", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) or "no primitive") + (
            f"; {self.bytes_moved / 1e6:.2f} MB moved (planned {self.predicted_bytes / 1e6:.2f} MB, minimum "
            f"{self.min_bytes / 1e6:.2f} MB); L_tran predicted {self.predicted_l_tran:.2f}s, measured "
            f"{self.measured_l_tran:.2f}s ({self.seconds:.2f}s with engine hand-over)")

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["primitives"] = [r.to_dict() for r in self.primitives]
        return d


def move_specs(dag, trainable: dict[str, bool], storage_seed: dict[str, int]) -> dict[str, MoveSpec]:
    """pid → :class:`MoveSpec` for every primitive of ``dag`` (metadata the workers execute).

    Args:
        trainable: model-stage → holds Adam state (moves :data:`TRAIN_KINDS`).
        storage_seed: model-stage → the seed its frozen weights were created from (a Load from
            storage re-creates them).

    Raises:
        ValueError: a Load whose source EMU cannot be found, or a Load from storage of a
            model-stage without a seed.
    """
    emus = {e.uid: e for e in dag.initial}
    for p in dag.nodes:
        for e in p.produces:
            emus[e.uid] = e
    out = {}
    for p in dag.nodes:
        meta = {u: UnitMeta.of(emus[u]) for u in p.reads + p.consumes if u in emus}
        prod = tuple(UnitMeta.of(e) for e in p.produces)
        kinds = TRAIN_KINDS if trainable.get(p.model_stage) and p.kind != "load" else WEIGHT_KINDS
        sources, local, seed = (), (), -1
        if p.kind in ("split", "merge"):  # a growth Merge also reads remote sources (transition/growth.py)
            local = tuple(meta[u] for u in p.consumes)
            sources = local + tuple(meta[u] for u in p.reads)
        elif p.kind == "extend":
            sources = tuple(meta[u] for u in p.reads)
        elif p.kind == "restore":
            sources = tuple(meta[u] for u in p.consumes)
        elif p.kind == "load" and p.source == STORAGE:
            if p.model_stage not in storage_seed:
                raise ValueError(f"{p.pid}: no stored weights known for {p.model_stage}")
            seed = storage_seed[p.model_stage]
        elif p.kind == "load":
            if p.reads:
                src = emus[p.reads[0]]
            else:  # sync from the train model-stage's target EMU on the primitive's first GPUs
                src = next((e for e in dag.target if e.model_stage == p.source
                            and tuple(p.gpus[:len(e.gpus)]) == e.gpus), None)
                if src is None:
                    raise ValueError(f"{p.pid}: no target EMU of {p.source} on GPUs {list(p.gpus)}")
            sources = (UnitMeta.of(src),)
        workers = set(p.gpus)
        for m in list(meta.values()) + list(prod) + list(sources):
            workers |= set(m.gpus)
        out[p.pid] = MoveSpec(pid=p.pid, kind=p.kind, model_stage=p.model_stage, consumes=p.consumes,
                              produces=prod, sources=sources, local=local, kinds=kinds, storage_seed=seed,
                              workers=tuple(sorted(workers)))
    return out


class TransitionExecutor:
    """Runs transition DAGs on an :class:`~nereus.runtime.run.driver.RLDriver`'s workers (module docstring)."""

    def __init__(self, driver) -> None:
        self.driver = driver

    def _trainable(self) -> dict[str, bool]:
        return {ms.name: ms.trainable for ms in self.driver.wf.model_stages}

    def _changed(self, dag, target: Plan) -> list[str]:
        d = self.driver
        touched = {p.model_stage for p in dag.nodes}
        out = []
        for ms in d.wf.model_stages:
            c = target[ms.name]
            lay = Layout(c.tp, c.pp, c.dp, tuple(c.gpus))
            now = d.cands[ms.name]
            if ms.name in touched or lay != d.layouts[ms.name] or (c.zero, c.offload) != (now.zero, now.offload):
                out.append(ms.name)
        return out

    def _splits(self, specs: dict, live: list[int]):
        """``(pool, member sets, name)`` for ``WorkerCore.transition_begin`` on CUDA workers with
        NCCL (the communicators the moves will use that no worker holds yet, ``comm/split.py``);
        None on gloo (each group is built by its members, ``comm/cache.py``)."""
        import torch
        import torch.distributed as dist

        if not (torch.cuda.is_available() and dist.is_nccl_available()):  # the pool's workers take GPUs alike
            return None
        from nereus.runtime.comm.split import SplitRegistry
        from nereus.runtime.transit.plans import plan_moves

        d = self.driver
        if getattr(d, "comm_splits", None) is None:
            d.comm_splits = SplitRegistry()
        d.comm_splits.sync({i: d.workers[i]._actor_id.hex() if hasattr(d.workers[i], "_actor_id")
                            else str(id(d.workers[i])) for i in live})
        sets = [plan_moves(d._spec_of(m.model_stage.partition(".")[0]), m).comm_workers for m in specs.values()
                if m.kind not in ("destroy", "offload") and m.storage_seed < 0]
        todo = d.comm_splits.plan(live, sets)
        return (live, todo, f"{d.tag}/split{d.comm_splits.calls}") if todo else None

    def execute(self, est: TransitionEstimate, target: Plan, adopt: bool = True) -> TransitionReport:
        """Move the driver's live state to ``target`` along ``est``'s DAG and schedule.

        Args:
            adopt: hand the engines of changing model-stages over to units first (the normal case);
                False when the workers already hold the DAG's initial EMUs as units and no engine
                (after a rollback, ``run/recovery.py``): every model-stage's engine is then rebuilt.

        Raises:
            ScheduleError: the schedule breaks a transition rule (nothing has moved).
            ValueError: the estimate is infeasible, or the DAG needs a worker that left (nothing
                has moved).
            WorkerFailure: a worker died or a communicator timed out while state moved.
        """

        d = self.driver
        if not est.feasible or est.dag is None:
            raise ValueError(f"transition is infeasible: {est.reason}")
        t0 = time.perf_counter()
        dag, sched = est.dag, est.schedule
        why = live_unsupported(dag, target, Plan(candidates=tuple(d.cands.values())))
        if why:
            raise ValueError(f"the live executor cannot run this transition: {why}")
        target = aligned_target(dag, target)  # a ZeRO group's DP rank order as the DAG chose it
        order = verify_schedule(dag, sched)
        specs = move_specs(dag, self._trainable(), d.storage_seeds())
        need = sorted({w for m in specs.values() for w in m.workers} | set(target.gpus_used()))
        gone = [w for w in need if w >= len(d.workers) or d.workers[w] is None]
        if gone:
            raise ValueError(f"transition needs workers {gone} that are not in the pool")
        changed = self._changed(dag, target) if adopt else [ms.name for ms in d.wf.model_stages]
        d.set_plan(target)  # validates the target against the job first (nothing moved yet)
        live = [i for i, w in enumerate(d.workers) if w is not None]
        metas = [UnitMeta.of(e) for e in dag.initial]
        split = self._splits(specs, live) if adopt else None  # NCCL: every live worker splits alike
        received = (d._get([d.workers[i].transition_begin.remote(changed, metas, split) for i in live],
                           "transition begin") if adopt else [])
        if split:
            d.comm_splits.done(split[1])
        futs: dict[str, list] = {}
        members: dict[str, set] = {}
        preds = dag.preds()
        for n, pid in enumerate(order):
            m = specs[pid]
            p = dag.node(pid)
            spec = d._spec_of(p.model_stage.partition(".")[0])
            futs[pid] = []
            members[pid] = set(m.workers)
            for w in m.workers:
                after = [futs[q][0] for q in sorted(preds.get(pid, ())) if w not in members[q] and futs[q]]
                futs[pid].append(d.workers[w].transition_run.remote(
                    spec, m, f"{d.tag}/x{n}/{pid}", bool(self._trainable().get(p.model_stage)), *after))
        # one monitored wait over every primitive's calls (not one per primitive): a loss in one
        # primitive is then reported only after the calls of all the others ended too, so no call is
        # left ungotten and every call a released rendezvous ended is counted (run/faults.py)
        flat = [f for fs in futs.values() for f in fs]
        got = d._get(flat, f"transition: {', '.join(futs)}"[:200],
                     timeout=4 * d.cfg.timeout_s * max(1, len(futs)))
        results, k = {}, 0
        for pid, fs in futs.items():
            results[pid], k = got[k:k + len(fs)], k + len(fs)
        finish = []
        fresh = dropped_targets(d, dag, changed)  # target drop: no unit; built as at the start, re-synced
        for ms in [m for m in changed if m not in fresh]:
            wf_ms = next(x for x in d.wf.model_stages if x.name == ms)
            lay = d.layouts[ms]
            adam = d.adam_config(ms) if wf_ms.trainable else None
            rc = d.recompute_of(ms)
            spec = d._spec_of(wf_ms.model)
            c = d.cands[ms]
            finish += [d.workers[i].transition_finish.remote(ms, spec, lay, wf_ms.trainable, adam, d.tag, rc,
                                                             zero=c.zero, offload=c.offload)
                       for i in lay.workers]
        d._get(finish, "transition finish: building engines in the target layouts")
        rebuild_dropped(d, fresh)
        left = d._get([d.workers[i].transition_end.remote(d.tag) for i in live], "transition end")
        stray = sorted({u for x in left for u in x})
        if stray:
            raise WorkerFailure(f"transition ended with units outside the target: {stray[:4]}")
        seconds = time.perf_counter() - t0
        driver_bytes = len(pickle.dumps((received, results, left)))
        return self._report(est, order, results, seconds, driver_bytes, self._fault_probes(results, live))

    def _fault_probes(self, results, live=()) -> dict:
        """Worker → its fresh-buffer first-touch seconds per byte (``transit/fault_probe.py``), once
        per worker process, CPU workers only: from the results (a measured worker reports it with
        each), else asked of the other ``live`` workers at once without measuring, and measured now
        for every worker that has not, after the transition and one worker at a time (four CPU
        workers at once on two cores would double it)."""
        d, known, todo = self.driver, {}, set()

        def probe(w):
            return getattr(d.workers[w], "fault_probe", None) if w < len(d.workers) and d.workers[w] else None

        for r in (r for rs in results.values() for r in rs):
            if "fault_s_per_byte" in r:
                known[r["worker"]] = r["fault_s_per_byte"]
            else:
                todo.add(r["worker"])
        others = [w for w in live if w not in known and w not in todo and probe(w) is not None]
        for w, got in zip(others, d._get([probe(w).remote(False) for w in others], "fault probes") if others else []):
            if got is None:
                todo.add(w)
            else:
                known[w] = got["s_per_byte"]
        for w in sorted(todo - set(known)):
            got = d._get([probe(w).remote(True)], f"fault probe on worker {w}")[0] if probe(w) is not None else None
            known[w] = got["s_per_byte"] if got else None
        return {w: t for w, t in known.items() if t is not None}

    def _report(self, est, order, results, seconds, driver_bytes, faults=None) -> TransitionReport:
        dag = est.dag
        preds = dag.preds()
        recs = []
        t_first = min((r["t_start"] for rs in results.values() for r in rs), default=0.0)
        t_last = max((r["t_end"] for rs in results.values() for r in rs), default=0.0)
        for pid in order:
            p, rs = dag.node(pid), results[pid]
            host = p.kind in ("offload", "restore")  # device ↔ host copies are what these move
            recv = sum(r["host_bytes"] if host else r["recv"] + r["storage_bytes"] for r in rs)
            recs.append(PrimitiveRecord(
                pid=pid, kind=p.kind, model_stage=p.model_stage, predicted_s=float((est.durations or {}).get(pid, 0.0)),
                measured_s=max(r["t_end"] for r in rs) - min(r["t_start"] for r in rs),
                setup_s=max(r["setup_s"] for r in rs), transfer_s=max(r["transfer_s"] for r in rs),
                predicted_bytes=int(p.bytes_moved), bytes_received=int(recv),
                sent={r["worker"]: r["sent"] for r in rs if r["sent"]},
                received={r["worker"]: r["recv"] for r in rs if r["recv"]},
                header_bytes=sum(r["header_bytes"] for r in rs),
                copy_s=max(r.get("pack_s", 0.0) + r.get("assemble_s", 0.0) for r in rs), copy_bytes=copy_bytes(p),
                pack_s=max(r.get("pack_s", 0.0) for r in rs), assemble_s=max(r.get("assemble_s", 0.0) for r in rs),
                t_start=min(r["t_start"] for r in rs) - t_first, t_ready=max(r["t_start"] for r in rs) - t_first,
                t_end=max(r["t_end"] for r in rs) - t_first, workers=len(rs),
                pack_bytes=max(p.sent.values(), default=0), assemble_bytes=max(p.alloc.values(), default=0),
                pack_strided=p.strided_sent, assemble_strided=p.strided_alloc, fresh_bytes=fresh_bytes(p),
                pack_workers=copy_workers(p)[0], assemble_workers=copy_workers(p)[1],
                fresh_recv_bytes=fresh_recv_bytes(p), preds=sorted(preds.get(pid, ())),
                worker_ids=sorted(r["worker"] for r in rs),
                freed_tensors=max((r.get("freed_tensors", 0) for r in rs), default=0),
                fault_s_per_byte={r["worker"]: faults[r["worker"]] for r in rs if r["worker"] in (faults or {})},
                pack_faults=max((r.get("pack_faults", 0) for r in rs), default=0),
                transfer_faults=max((r.get("transfer_faults", 0) for r in rs), default=0)))
        return TransitionReport(primitives=recs, predicted_l_tran=float(est.l_tran),
                                measured_l_tran=max(0.0, t_last - t_first), seconds=seconds,
                                predicted_bytes=int(est.bytes_moved),
                                bytes_moved=sum(r.bytes_received for r in recs), min_bytes=int(est.min_bytes),
                                driver_bytes=driver_bytes)
