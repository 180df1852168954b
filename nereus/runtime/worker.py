"""One worker per device: the engines of every model-stage placed on it (DESIGN.md §4.7).

:class:`WorkerCore` is a plain class so tests can run it in spawned processes; :func:`ray_worker_class`
wraps it as a Ray actor (one per device, ``num_cpus=1`` on CPU, ``num_gpus=1`` on GPU). Every method
that takes a model-stage name is timed under that name in the worker's :class:`Meter`.

A worker joins the job by connecting to the driver's ``TCPStore``; groups among any subset of
workers are then built on demand (``comm.new_group``), so no world-wide init is needed.
"""

from __future__ import annotations

import os

import torch

from nereus.runtime.comm import DEFAULT_TIMEOUT_S, connect_store, new_group
from nereus.runtime.engine import AdamConfig, Engine, broadcast_stages
from nereus.runtime.instrument import Meter
from nereus.runtime.parallel import Layout, build_context
from nereus.runtime.rollout import generate
from nereus.spec.model import ModelSpec

__all__ = ["WorkerCore", "inventory", "ray_worker_class", "resolve_dtype"]


def inventory() -> dict:
    """This machine's devices: ``{"cpus", "cuda_devices": [{"name", "memory_bytes"}], "ray": {...}}``.

    NVML (``pynvml``) is used when CUDA is present and it is installed; torch's device properties
    otherwise; CPU count always; Ray's cluster resources when Ray is initialized.
    """
    out: dict = {"cpus": os.cpu_count() or 1, "cuda_devices": [], "ray": {}}
    if torch.cuda.is_available():
        try:
            import pynvml

            pynvml.nvmlInit()
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                out["cuda_devices"].append({"name": str(pynvml.nvmlDeviceGetName(h)),
                                            "memory_bytes": int(pynvml.nvmlDeviceGetMemoryInfo(h).total)})
        except Exception:  # NVML absent or unusable: fall back to torch
            for i in range(torch.cuda.device_count()):
                p = torch.cuda.get_device_properties(i)
                out["cuda_devices"].append({"name": p.name, "memory_bytes": int(p.total_memory)})
    try:
        import ray

        if ray.is_initialized():
            out["ray"] = {k: float(v) for k, v in ray.cluster_resources().items()}
    except ImportError:
        pass
    return out


def resolve_dtype(name: str, trainable: bool, device: str) -> torch.dtype:
    """The parameter dtype of an engine: fp32 on CPU; bf16 for forward-only model-stages on a device
    that supports it (``auto``). Raises ValueError for unknown names or bf16 training."""
    if name == "auto":
        bf16 = device.startswith("cuda") and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if bf16 and not trainable else torch.float32
    if name == "float32":
        return torch.float32
    if name == "bfloat16":
        if trainable:
            raise ValueError("dtype 'bfloat16' is for forward-only model-stages; training keeps fp32 "
                             "(master) weights")
        return torch.bfloat16
    raise ValueError(f"dtype must be 'auto', 'float32' or 'bfloat16', got {name!r}")


def _cpu(x):
    return None if x is None else x.cpu()


class WorkerCore:
    """Holds the store connection, the meter and one :class:`Engine` per model-stage placed here.

    Args:
        worker_id: this worker's id (its device index in plans).
        store_host, store_port: the driver's TCPStore.
        timeout_s: timeout of every group this worker builds.
    """

    def __init__(self, worker_id: int, store_host: str, store_port: int,
                 timeout_s: float = DEFAULT_TIMEOUT_S, threads: int = 1) -> None:
        torch.set_num_threads(threads)
        self.id = int(worker_id)
        self.timeout_s = float(timeout_s)
        self.store = connect_store(store_host, store_port, timeout_s)
        self.meter = Meter()
        self.engines: dict[str, Engine] = {}
        self.groups: dict[str, object] = {}
        self.device = "cuda" if torch.cuda.is_available() else "cpu"

    def ping(self) -> int:
        return self.id

    def pid(self) -> int:
        return os.getpid()

    def inventory(self) -> dict:
        return inventory()

    # ------------------------------------------------------------------ setup
    def build(self, model_stage: str, spec: ModelSpec, layout: Layout, seed: int, trainable: bool,
              adam: AdamConfig | None = None, tag: str = "e0", dtype: str = "auto",
              schedule: str = "1f1b", recompute: str = "none") -> tuple[int, int, int]:
        """Build this worker's engine of ``model_stage`` (collective over the layout's workers).

        Args:
            dtype: ``auto`` (bf16 for forward-only model-stages where the device supports it, else
                fp32), ``float32`` or ``bfloat16`` (forward-only model-stages only: training keeps
                fp32 weights, which are also Adam's master weights).
            schedule: pipeline schedule of training, ``1f1b`` or ``gpipe``.
            recompute: activation recomputation of training, ``none``, ``selective`` or ``full``.

        Returns:
            this worker's (d, p, t).

        Raises:
            ValueError: invalid layout, or a dtype that is unknown or bf16 for a trainable stage.
        """
        dt = resolve_dtype(dtype, trainable, self.device)
        with self.meter.stage(model_stage):
            ctx = build_context(spec, layout, self.id, self.store, f"{tag}/{model_stage}", self.meter,
                                self.timeout_s)
            self.engines[model_stage] = Engine(spec, ctx, seed, self.meter, trainable, adam, dt, self.device,
                                               schedule=schedule, recompute=recompute)
        return ctx.d, ctx.p, ctx.t

    def destroy(self, model_stage: str) -> None:
        """Drop this worker's engine of ``model_stage`` (local teardown, no collective)."""
        e = self.engines.pop(model_stage, None)
        if e is not None:
            self.meter.drop_static(f"params:{id(e)}")

    def _engine(self, model_stage: str) -> Engine:
        if model_stage not in self.engines:
            raise ValueError(f"worker {self.id} holds no engine for model-stage {model_stage!r}; "
                             f"it holds {sorted(self.engines)}")
        return self.engines[model_stage]

    # ------------------------------------------------------------------ model-stage work
    def generate(self, model_stage: str, prompts: torch.Tensor, seeds: list[int], max_new_tokens: int,
                 temperature: float = 1.0, greedy: bool = False, eos_id: int = 2, pad_id: int = 0,
                 concurrency: int = 0):
        """Responses ``[B, R]`` for this replica's prompts ``[B, P]``, in waves of at most
        ``concurrency`` sequences (0: all at once), as a KV-cache budget requires."""
        with self.meter.stage(model_stage):
            e = self._engine(model_stage)
            wave = concurrency if concurrency > 0 else prompts.shape[0]
            outs = [generate(e.model, prompts[i:i + wave].to(self.device), max_new_tokens, seeds[i:i + wave],
                             temperature, greedy, eos_id, pad_id) for i in range(0, prompts.shape[0], wave)]
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
                     policy_version: int, tag: str = "e0") -> None:
        """Move ``src``'s parameters (replica 0) to every replica of ``dst`` in ``dst``'s layout.

        Collective over replica 0 of ``src`` plus all of ``dst``: each PP rank ``q`` of the source
        all-gathers its TP shards, its TP rank 0 broadcasts the flat full stage, and each destination
        worker keeps its own shards. Timed under ``dst``.
        """
        members = tuple(sorted(set(src_layout.replica(0)) | set(dst_layout.workers)))
        if self.id not in members:
            return
        with self.meter.stage(dst):
            key = f"{tag}/sync/{src}->{dst}"
            if key not in self.groups:
                self.groups[key] = new_group(self.store, key, members, self.id, self.meter, self.timeout_s)
            group = self.groups[key]
            roots = [members.index(src_layout.worker(0, q, 0)) for q in range(src_layout.pp)]
            mine, my_p = None, None
            if src in self.engines and self.id in src_layout.replica(0):
                e = self.engines[src]
                mine, my_p = e._full_stage(e.model.params), e.ctx.p
            full = broadcast_stages(spec, src_layout.pp, mine, my_p, group, roots)
            if dst in self.engines:
                d = self.engines[dst]
                d.load_full(full)
                d.version += 1
                d.policy_version = int(policy_version)

    # ------------------------------------------------------------------ measurements and faults
    def measurements(self) -> dict:
        m = self.meter.measurements()
        m["worker"] = self.id
        return m

    def reset_measurements(self) -> None:
        self.meter.reset()

    def crash(self) -> None:
        """Exit the process at once (fault-injection for tests)."""
        os._exit(1)


def ray_worker_class(num_gpus: float = 0):
    """``WorkerCore`` as a Ray actor class taking one device (one CPU, or one GPU when ``num_gpus``)."""
    import ray

    return ray.remote(num_cpus=1, num_gpus=num_gpus, max_restarts=0)(WorkerCore)
