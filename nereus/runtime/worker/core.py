"""One worker per device: the engines of every model-stage placed on it (DESIGN.md §4.7).

:class:`WorkerCore` is a plain class so tests can run it in spawned processes; :func:`ray_worker_class`
wraps it as a Ray actor (one per device, ``num_cpus=1`` on CPU, ``num_gpus=1`` on GPU). Every method
that takes a model-stage name is timed under that name in the worker's :class:`Meter`.

A worker joins the job by connecting to the driver's ``TCPStore``; groups among any subset of
workers are then built on demand (``comm.new_group``), so no world-wide init is needed.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from nereus.runtime.comm.groups import DEFAULT_TIMEOUT_S, connect_store
from nereus.runtime.comm.instrument import Meter
from nereus.runtime.comm.parallel import Layout, build_context
from nereus.runtime.durable.worker_calls import CheckpointCallsMixin
from nereus.runtime.model.precision import WEIGHT_KINDS
from nereus.runtime.transit.packing import COUNTERS
from nereus.runtime.transit.plans import MoveSpec, UnitMeta, kinds_for
from nereus.runtime.transit.residency import adopt_engine, build_engine
from nereus.runtime.transit.worker_side import Transit, Unit
from nereus.runtime.worker.device import inventory, resolve_dtype, select_device
from nereus.runtime.worker.engine import AdamConfig, Engine
from nereus.runtime.worker.host_alloc import cache_host_frees
from nereus.runtime.worker.memory_pool import MemoryPools
from nereus.runtime.worker.rollout import generate
from nereus.runtime.worker.vllm_worker import VllmWorkerMixin
from nereus.runtime.worker.zero import make_engine
from nereus.runtime.worker.zero3 import colocated_sync
from nereus.spec.model import ModelSpec

__all__ = ["WorkerCore", "ray_worker_class", "PRECISION_KEY"]

#: TCPStore key under which the driver publishes a run's precision (``RLDriver.publish_precision``):
#: a worker that builds no engine itself (one that joins for a transition) reads it from there
PRECISION_KEY = "nereus/precision"


def _cpu(x):
    return None if x is None else x.cpu()


class WorkerCore(CheckpointCallsMixin, VllmWorkerMixin):
    """Holds the store connection, the meter and one :class:`Engine` per model-stage placed here
    (and, with ``--rollout vllm``, the vLLM engines of generation model-stages: ``vllm_worker.py``).

    Args:
        worker_id: this worker's id (its device index in plans).
        store_host, store_port: the driver's TCPStore.
        timeout_s: timeout of every group this worker builds.
    """

    def __init__(self, worker_id: int, store_host: str, store_port: int,
                 timeout_s: float = DEFAULT_TIMEOUT_S, threads: int = 1) -> None:
        torch.set_num_threads(threads)
        self.host_cache = cache_host_frees()  # freed host memory reused: transition buffers fault alike
        self.id = int(worker_id)
        self.timeout_s = float(timeout_s)
        self.store = connect_store(store_host, store_port, timeout_s)
        self.meter = Meter()
        self.engines: dict[str, Engine] = {}
        self.groups: dict[str, object] = {}
        self.device = select_device(self.id)  # one CUDA device per worker (Ray's assigned GPU)
        if self.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(self.device))  # NCCL groups bind the current device
        self.transit = Transit(self.id, self.store, self.meter, self.timeout_s)
        self.built: dict[str, dict] = {}  # model-stage → how its engine was built (dtype, schedule, recompute)
        self.pools = MemoryPools(self.meter, self.device)  # device capacity, host pool (worker/memory_pool.py)

    def ping(self) -> int:
        return self.id

    def pid(self) -> int:
        return os.getpid()

    def inventory(self) -> dict:
        return inventory()

    # ------------------------------------------------------------------ setup
    def build(self, model_stage: str, spec: ModelSpec, layout: Layout, seed: int, trainable: bool,
              adam: AdamConfig | None = None, tag: str = "e0", dtype: str = "auto",
              schedule: str = "1f1b", recompute: str = "none", precision: str = "fp32", zero: int = 0,
              offload: str = "none") -> tuple[int, int, int]:
        """Build this worker's engine of ``model_stage`` (collective over the layout's workers).

        Args:
            dtype: with ``precision="fp32"``: ``auto`` (bf16 for forward-only model-stages where the
                device supports it, else fp32), ``float32`` or ``bfloat16`` (forward-only model-stages
                only: training keeps fp32 weights, which are also Adam's master weights).
            precision: ``fp32`` or ``bf16`` (every engine bf16, trainable ones with fp32 master
                weights, gradients and moments; ``worker/engine.py``).
            schedule: pipeline schedule of training, ``1f1b`` or ``gpipe``.
            recompute: activation recomputation of training, ``none``, ``selective`` or ``full``.
            zero: ZeRO stage of a training model-stage (0 or 1, ``worker/zero.py``).
            offload: what the state does while another model-stage runs here: ``none``, ``host`` or
                ``drop`` (``worker/memory_pool.py``); idle offloadable model-stages make room first.

        Returns:
            this worker's (d, p, t).

        Raises:
            ValueError: invalid layout, an unknown precision, or a dtype that is unknown or bf16 for a
                trainable stage of an fp32 run.
        """
        dt = resolve_dtype(dtype, trainable, self.device, precision)
        self.pools.set_mode(model_stage, offload)
        self.pools.make_room(self.engines, {model_stage})
        with self.meter.stage(model_stage):
            ctx = build_context(spec, layout, self.id, self.store, f"{tag}/{model_stage}", self.meter,
                                self.timeout_s, self.device)
            self.engines[model_stage] = make_engine(zero, spec, ctx, seed, self.meter, trainable, adam, dt,
                                                    self.device, schedule=schedule, recompute=recompute,
                                                    precision=precision)
        self.built[model_stage] = {"dtype": dtype, "schedule": schedule, "recompute": recompute,
                                   "precision": precision, "zero": zero, "offload": offload}
        return ctx.d, ctx.p, ctx.t

    def precision_of(self, model_stage: str) -> str:
        """The precision of ``model_stage`` on this worker: the run's as the driver published it
        (:data:`PRECISION_KEY`), else how this worker built the stage, else ``fp32``."""
        try:
            if self.store.check([PRECISION_KEY]):
                return self.store.get(PRECISION_KEY).decode()
        except RuntimeError:  # store unreachable: fall back to what this worker knows
            pass
        return self.built.get(model_stage, {}).get("precision", "fp32")

    def _dtype_of(self, model_stage: str, trainable: bool) -> torch.dtype:
        return resolve_dtype(self.built.get(model_stage, {}).get("dtype", "auto"), trainable, self.device,
                             self.precision_of(model_stage))

    def destroy(self, model_stage: str) -> None:
        """Drop this worker's engine of ``model_stage`` (local teardown, no collective)."""
        e = self.engines.pop(model_stage, None)
        if e is not None:
            self.meter.drop_static(f"params:{id(e)}")
        self.pools.forget(model_stage)

    def _engine(self, model_stage: str) -> Engine:
        """The engine of ``model_stage``, made resident for its turn (``MemoryPools.activate``)."""
        if model_stage not in self.engines:
            raise ValueError(f"worker {self.id} holds no engine for model-stage {model_stage!r}; "
                             f"it holds {sorted(self.engines)}")
        self.pools.activate(self.engines, {model_stage})
        return self.engines[model_stage]

    def set_capacity(self, nbytes: int | None) -> None:
        """This worker's device-memory capacity in bytes (None or 0: unlimited; ``MemoryPools``)."""
        self.pools.set_capacity(nbytes)

    # ------------------------------------------------------------------ model-stage work
    def generate(self, model_stage: str, prompts: torch.Tensor, seeds: list[int], max_new_tokens: int,
                 temperature: float = 1.0, greedy: bool = False, eos_id: int = 2, pad_id: int = 0,
                 concurrency: int = 0):
        """Responses ``[B, R]`` for this replica's prompts ``[B, P]``, in waves of at most
        ``concurrency`` sequences (0: all at once), as a KV-cache budget requires. A model-stage served
        by vLLM (:meth:`build_vllm`) returns ``(responses, log-probs)`` from its engine instead."""
        if self.serves_vllm(model_stage):
            return self.vllm_generate(model_stage, prompts, seeds, max_new_tokens, temperature, greedy, eos_id,
                                      pad_id)
        with self.meter.stage(model_stage):
            e = self._engine(model_stage)
            wave = concurrency if concurrency > 0 else prompts.shape[0]
            try:
                outs = [generate(e.model, prompts[i:i + wave].to(self.device), max_new_tokens, seeds[i:i + wave],
                                 temperature, greedy, eos_id, pad_id) for i in range(0, prompts.shape[0], wave)]
            finally:
                self.meter.drop_static("kv_cache")  # the cache is freed with the rollout
            return torch.cat(outs)

    def logprobs(self, model_stage: str, tokens: torch.Tensor, prompt_len: int, micro_batch: int,
                 temperature: float = 1.0):
        with self.meter.stage(model_stage):
            return _cpu(self._engine(model_stage).logprobs(tokens.to(self.device), prompt_len, micro_batch,
                                                           temperature))

    def values(self, model_stage: str, tokens: torch.Tensor, prompt_len: int, micro_batch: int):
        with self.meter.stage(model_stage):
            return _cpu(self._engine(model_stage).values(tokens.to(self.device), prompt_len, micro_batch))

    def forward(self, model_stage: str, tokens: torch.Tensor, micro_batch: int):
        with self.meter.stage(model_stage):
            return _cpu(self._engine(model_stage).forward(tokens.to(self.device), micro_batch))

    def backward_lm(self, model_stage: str, tokens: torch.Tensor, micro_batch: int, denom: float):
        with self.meter.stage(model_stage):
            return self._engine(model_stage).backward_lm(tokens.to(self.device), micro_batch, denom)

    def train(self, model_stage: str, batch: dict, loss: dict, micro_batch: int, denom: float,
              position: int):
        with self.meter.stage(model_stage):
            batch = {k: v.to(self.device) for k, v in batch.items()}
            return self._engine(model_stage).train_step(batch, loss, micro_batch, denom, position)

    def save_hf(self, model_stage: str, directory: str) -> int:
        """Write replica 0 of ``model_stage`` as a Hugging Face directory (``hf.save_stage``; collective
        over that replica's TP groups); returns bytes this worker wrote (0 off replica 0)."""
        from nereus.runtime.model.hf import save_stage

        e = self._engine(model_stage)
        if e.ctx.d != 0:
            return 0
        with self.meter.stage(model_stage):
            return save_stage(e, directory)

    def train_fields(self, model_stage: str, *xs):
        """:meth:`train` with the batch given as tensors then their field names: ``(*tensors, names,
        loss, micro_batch, denom, position)`` (how the driver splits a batch per replica)."""
        *tensors, names, loss, b, denom, position = xs
        return self.train(model_stage, dict(zip(names, tensors)), loss, b, denom, position)

    def gather(self, model_stage: str, kind: str = "params") -> dict:
        return self._engine(model_stage).gather_full(kind)

    def gather_logical_state(self, model_stage: str) -> dict:
        return self._engine(model_stage).gather_logical_state()

    def load_logical_state(self, model_stage: str, state: dict) -> None:
        """Load this worker's shards of a gathered logical state (``Engine.load_logical_state``)."""
        with self.meter.stage(model_stage):
            self._engine(model_stage).load_logical_state(state)

    def sync_weights(self, src: str, dst: str, src_layout: Layout, dst_layout: Layout, spec: ModelSpec,
                     policy_version: int, tag: str = "e0") -> dict:
        """Move ``src``'s parameters (replica 0) into every replica of ``dst``, rank-aligned.

        Each destination rank receives only the parameter pieces of its own shard that it does not
        already hold in ``src`` on the same worker, from the source ranks that hold them
        (``shards.plan_moves``, as a live Extend or Load does; DESIGN.md §4.8), one contiguous
        buffer per (sender, receiver) pair. Collective over the workers that send or receive; the
        communicator is kept for later steps of the same layouts. Timed under ``dst``.

        Returns:
            bytes this worker sent and received.
        """
        members = set(src_layout.replica(0)) | set(dst_layout.workers)
        out = {"sent": 0, "recv": 0, "setup_s": 0.0, "transfer_s": 0.0, "header_bytes": 0}
        e = self.engines.get(src)
        sharded = e is not None and getattr(e, "zero", 0) == 3 and self.id in src_layout.workers
        if self.id not in members and not sharded:
            return out
        frozen = dst in self.engines and not self.engines[dst].trainable  # a derived copy: all rewritten
        if sharded and colocated_sync(src_layout, dst_layout):  # unit by unit, in place (worker/zero3.py)
            return self._sync_from_slices(e, src, dst, policy_version, frozen, out)
        if colocated_sync(src_layout, dst_layout):  # every destination shard is on its source's worker
            return self._sync_local(e, src, dst, policy_version, frozen, out)
        self.pools.activate(self.engines, {src, dst}, {dst} if frozen else ())  # both take this turn
        with self.meter.stage(dst):
            # a ZeRO-3 source: every replica joins the DP all-gather of its (p, t) shard (worker/zero3.py)
            shards = e.shard_params() if sharded else None
            if shards is not None:  # held while the exchange runs
                self.meter.set_static("sync_shard", sum(t.numel() * t.element_size() for t in shards.values()))
            if self.id not in members:
                return out
            src_meta = UnitMeta(f"{src}#0", src, src_layout.tp, src_layout.pp, src_layout.replica(0))
            dst_metas = tuple(UnitMeta(f"{dst}#{d}", dst, dst_layout.tp, dst_layout.pp, dst_layout.replica(d))
                              for d in range(dst_layout.dp))
            move = MoveSpec(pid=f"sync:{src}->{dst}", kind="sync", model_stage=dst, produces=dst_metas,
                            sources=(src_meta,), kinds=WEIGHT_KINDS)
            units = {}
            if e is not None and self.id in src_meta.gpus:
                params = shards if shards is not None else {n: w.detach() for n, w in e.model.params.items()}
                units[src_meta.uid] = Unit(src_meta, {"params": params}, {})
            d_eng = self.engines.get(dst)
            dtype = self._dtype_of(dst, False)
            made = self.transit.exchange(spec, move, units, f"{tag}/sync/{src}->{dst}", dtype, self.device, out)
            if d_eng is not None:
                mine = next(u for u in made.values())
                if hasattr(d_eng, "load_shard_params"):  # a ZeRO-3 destination keeps its slices
                    d_eng.load_shard_params(mine.tensors["params"])
                else:
                    with torch.no_grad():
                        for n, w in d_eng.model.params.items():
                            w.copy_(mine.tensors["params"][n])
                d_eng.version += 1
                d_eng.policy_version = int(policy_version)
            self.meter.drop_static("sync_shard")
        if self.serves_vllm(dst):  # served by vLLM: hand the new shards over
            out["vllm"] = self.vllm_push(dst)
        return out

    @torch.no_grad()
    def _sync_local(self, e, src: str, dst: str, policy_version: int, frozen: bool, out: dict) -> dict:
        """A weight sync whose destination shards all sit on workers holding the same source shard:
        deferred to the destination's turn when it is a dropped derived copy
        (``MemoryPools.defer``), else copied here from the source's parameters where they are (its
        host copy when offloaded: the source is not restored for the sync)."""
        d_eng = self.engines.get(dst)
        if d_eng is None:
            return out
        version = d_eng.version + 1
        vllm = self.serves_vllm(dst)  # its engine is read by the push below: written now
        if vllm or not (frozen and not hasattr(d_eng, "load_shard_params")
                        and self.pools.defer(dst, d_eng, src, self.engines, version)):
            self.pools.activate(self.engines, {dst}, {dst} if frozen else ())
            with self.meter.stage(dst):
                params = self.pools.params_of(src, e)
                if hasattr(d_eng, "load_shard_params"):
                    d_eng.load_shard_params(params)
                else:
                    for n, w in d_eng.model.params.items():
                        w.copy_(params[n])
        d_eng.version = version
        d_eng.policy_version = int(policy_version)
        if vllm:
            out["vllm"] = self.vllm_push(dst)
        return out

    def _sync_from_slices(self, e, src: str, dst: str, policy_version: int, frozen: bool, out: dict) -> dict:
        """A weight sync from a ZeRO-3 source into destinations of the same (p, t) shards on the same
        workers: only the destination is made resident; the source's parameter slices are read where
        they are (the host pool when offloaded) and gathered one unit at a time
        (``ShardedEngine.sync_units``)."""
        d_eng = self.engines.get(dst)
        self.pools.activate(self.engines, {dst} if d_eng is not None else set(), {dst} if frozen else ())
        held = self.pools.host.get(src, {}).get("params") if src in self.pools.offloaded else None
        with self.meter.stage(dst):
            out["sent"] = e.sync_units(d_eng, None if held is None else
                                       {u: h.to(self.device) for u, h in held.items()})
        if d_eng is not None:
            d_eng.version += 1
            d_eng.policy_version = int(policy_version)
            if self.serves_vllm(dst):
                out["vllm"] = self.vllm_push(dst)
        return out

    # ------------------------------------------------------------------ live transitions (transit.py)
    def transition_begin(self, model_stages: list[str], metas: list[UnitMeta], split=None) -> list[str]:
        """Turn the engines of ``model_stages`` into units (``Transit.adopt``) under the uids of
        ``metas`` that include this worker; an engine of a replica that is not in ``metas`` (it lost
        a worker) is dropped. Old communicators of those model-stages go with their engines.
        ``split``: ``(pool, member sets, name)`` on NCCL, every live worker the same: first split
        the transition's new communicators from a job-wide one (``GroupCache.split``, comm/split.py).

        Returns:
            uids of the units this worker now holds.
        """
        if split:
            pool, todo, name = split
            self.transit.comms.split(pool, [tuple(s) for s in todo], name, self.device)
        for ms in model_stages:
            e = self.engines.pop(ms, None)
            if e is None:
                continue
            meta = next((m for m in metas if m.model_stage == ms and self.id in m.gpus), None)
            if meta is not None:  # host copies and ZeRO slices as the planner sees them (transit/residency.py)
                adopt_engine(self.transit, self.pools, ms, e, meta, self.id)
            else:
                self.pools.forget(ms)
            self.meter.drop_static(f"params:{id(e)}")
        return sorted(self.transit.units)

    def fault_probe(self, measure: bool = True) -> dict | None:
        """``Transit.fault_probe`` on this worker's device (measured once per process)."""
        return self.transit.fault_probe(self.device, measure)

    def transition_run(self, spec: ModelSpec, move: MoveSpec, group_name: str, trainable: bool,
                       *after) -> dict:
        """Run this worker's part of one primitive (``Transit.run``); ``after`` are the results of
        primitives it must follow that share no worker with it (Ray resolves them first)."""
        dtype = self._dtype_of(move.model_stage, trainable)
        move = replace(move, kinds=kinds_for(move.kinds, self.precision_of(move.model_stage)))
        # a source the planner sees in host memory is read there (a Load from an offloaded train
        # model-stage: host → device, transition/primitives.load), the others made resident first
        self.pools.activate(self.engines, {m.model_stage for m in move.sources if self.id in m.gpus and not m.host})
        live = {}  # a Load may read a train model-stage that is not changing: its engine, as a unit view
        for m in move.sources:
            e = self.engines.get(m.model_stage)
            if m.uid not in self.transit.units and e is not None and self.id in m.gpus:
                live[m.uid] = Unit(m, {"params": dict(self.pools.params_of(m.model_stage, e))},
                                   {k: int(getattr(e, k)) for k in COUNTERS})
        with self.meter.stage("transition"):
            return self.transit.run(spec, move, group_name, dtype, self.device, live)

    def transition_finish(self, model_stage: str, spec: ModelSpec, layout: Layout, trainable: bool,
                          adam: AdamConfig | None, tag: str, recompute: str = "none", zero: int = 0,
                          offload: str = "none") -> tuple[int, int, int]:
        """Build the engine of ``model_stage`` in ``layout`` (ZeRO stage ``zero``, idle residency
        ``offload``) from this worker's unit of the target EMU (collective over the layout's workers:
        its new communicators; ``transit/residency.py``)."""
        d, _, _ = layout.position(self.id)
        group = zero and layout.dp > 1  # a ZeRO group is one unit on all its workers
        unit = self.transit.take(model_stage, layout.tp, layout.pp, tuple(layout.workers) if group else layout.replica(d))
        how = self.built.get(model_stage, {})
        precision = self.precision_of(model_stage)
        dt = self._dtype_of(model_stage, trainable)
        with self.meter.stage(model_stage):
            ctx = build_context(spec, layout, self.id, self.store, f"{tag}/{model_stage}", self.meter,
                                self.timeout_s, self.device)
            build_engine(self.pools, self.engines, model_stage, unit, zero, offload, spec, ctx, 0, self.meter,
                         trainable, adam, dt, self.device, schedule=how.get("schedule", "1f1b"),
                         recompute=recompute, precision=precision)
        self.built[model_stage] = {**how, "recompute": recompute, "precision": precision, "zero": zero,
                                   "offload": offload}
        return ctx.d, ctx.p, ctx.t

    def transition_end(self, tag: str) -> list[str]:
        """Drop any unit left over; returns the uids dropped (none after a transition that reached
        its target). Communicators stay (``transit.comms``, by member set) for the next weight sync
        and transition."""
        left = sorted(self.transit.units)
        self.transit.units.clear()
        return left

    def forget_worker(self, worker: int) -> list[str]:
        """Drop the communicators that have ``worker`` as a member (it left the pool); returns their
        names (``comm/cache.py``)."""
        return self.transit.comms.forget(worker)

    def comm_stats(self) -> dict:
        """Communicators built, reused and held, and seconds spent building them (``GroupCache.stats``)."""
        return self.transit.comms.stats()

    def unit_bytes(self) -> dict:
        """uid → bytes of every unit held (inspection during a transition)."""
        return {uid: u.nbytes for uid, u in self.transit.units.items()}

    # ------------------------------------------------------------------ measurements and faults
    def measurements(self) -> dict:
        m = self.meter.measurements()
        m["worker"] = self.id
        m["memory"] = self.pools.stats()
        return m

    def reset_measurements(self) -> None:
        self.meter.reset()
        self.pools.reset_stats()

    def crash(self) -> None:
        """Exit the process at once (fault-injection for tests)."""
        os._exit(1)







def ray_worker_class(num_gpus: float = 0):
    """``WorkerCore`` as a Ray actor class taking one device (one CPU, or one GPU when ``num_gpus``)."""
    import ray

    return ray.remote(num_cpus=1, num_gpus=num_gpus, max_restarts=0)(WorkerCore)
