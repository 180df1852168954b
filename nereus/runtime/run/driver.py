"""The RL loop as the Ray driver: one synchronous step of PPO, GRPO or ReMax over a plan (DESIGN.md §4.1).

Each model-stage runs on the layout and workers its :class:`~nereus.spec.plan.Candidate` gives
(``gpus`` are worker ids, ordered ``gpus[(d*pp+p)*tp+t]``). One step:

1. ``actor.generate``: ``prompts_per_step × samples_per_prompt`` sampled rollouts, split over the
   generation replicas (ReMax adds one greedy rollout per prompt, its baseline).
2. rewards (the task's rule, or ``reward.infer`` running a reward model), ``actor.infer`` old
   log-probs, ``reference.infer`` log-probs (with a reference model), ``critic.infer`` values (PPO).
3. advantages on the driver (GAE / group-normalized / greedy baseline), then ``actor.train`` and
   ``critic.train``: ``ppo_epochs × global/mini_batch`` updates, each mini-batch split over ``dp``
   replicas of ``b × a`` sequences (``dp·b·a = mini_batch_size``, kept whatever dp is).
4. weight sync ``actor.train → actor.generate, actor.infer`` and ``critic.train → critic.infer``.

Every remote call has a timeout; a dead worker or failed collective raises :class:`WorkerFailure`.
"""

from __future__ import annotations

import time
import uuid
import zlib

import torch

from nereus.runtime.comm.parallel import Layout
from nereus.runtime.model.sharding import validate_layout
from nereus.runtime.rl import algorithms as alg
from nereus.runtime.rl.task import DigitTask
from nereus.runtime.run import vllm_driver as vd
from nereus.runtime.run.config import RLConfig
from nereus.runtime.run.features import check_runtime_features
from nereus.runtime.run.pool import WorkerPool, _ray_get
from nereus.runtime.worker.core import PRECISION_KEY
from nereus.runtime.worker.engine import AdamConfig
from nereus.runtime.worker.failures import WorkerFailure
from nereus.runtime.worker.memory_pool import MOVE_KEYS
from nereus.runtime.worker.rollout import response_mask
from nereus.spec.model import ModelSpec
from nereus.spec.plan import Candidate, Plan
from nereus.spec.workload import WorkloadSpec
from nereus.workflow import workflow_for

__all__ = ["RLDriver"]


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def _largest_divisor(n: int, cap: int) -> int:
    return next(b for b in range(max(1, min(cap, n)), 0, -1) if n % b == 0)  # 1 always divides


class RLDriver:
    """Runs RL steps of ``workload`` on Ray workers laid out by ``plan``.

    Args:
        spec: the actor's model (critic and reward model use its value-head variant).
        workload: algorithm and batch sizes.
        plan: one candidate per model-stage of ``workflow_for(workload)``; empty GPU sets are
            filled with workers ``0..n-1``.
        task: the built-in verifiable task.
        num_workers: Ray actors to start (one per device).

    Raises:
        ValueError: at construction: missing model-stages, an impossible layout (more workers than
            given, TP not dividing heads, ...), ``dp·b·a != mini_batch_size``, batches not divisible
            by DP, or a model vocabulary too small for the task's tokenizer.
    """

    def __init__(self, spec: ModelSpec, workload: WorkloadSpec, plan: Plan, task: DigitTask,
                 num_workers: int, cfg: RLConfig | None = None) -> None:
        self.spec, self.workload, self.task = spec, workload, task
        self.cfg = cfg or RLConfig()
        self.num_workers = int(num_workers)
        self.wf = workflow_for(workload)
        if not workload.reference_model and self.cfg.kl_coef > 0:  # no reference.infer to take a KL against
            raise ValueError(f"rl field 'kl_coef'={self.cfg.kl_coef} needs a reference model (reference_model false)")
        self.R = self.cfg.max_new_tokens or task.target_len
        task.check_vocab(spec.vocab_size)
        self.set_plan(plan)
        self.workers: list = []
        self.step_index = self.updates = 0

    def set_plan(self, plan: Plan) -> None:
        """Validate ``plan`` and make it the layout of the engines built next (:meth:`build_engines`,
        under a fresh group tag); ``run/relayout.py`` calls it between steps, after the old engines' teardown."""
        cands: dict[str, Candidate] = {}
        for ms in self.wf.model_stages:
            if ms.name not in plan:
                raise ValueError(f"plan lacks model-stage {ms.name!r}; the {self.wf.algorithm} workflow "
                                 f"needs {[m.name for m in self.wf.model_stages]}")
            c = plan[ms.name]
            if not c.gpus:
                c = c.with_gpus(range(c.num_gpus))
            if max(c.gpus) >= self.num_workers:
                raise ValueError(f"model-stage {ms.name}: layout tp={c.tp} pp={c.pp} dp={c.dp} uses workers "
                                 f"{c.gpus} but only {self.num_workers} workers are given")
            validate_layout(self._spec_of(ms.model), c.tp, c.pp)
            self._check_batches(ms.name, ms.stage, c)
            check_runtime_features(ms.name, c)
            cands[ms.name] = c
        self.cands = cands  # assigned only once every candidate passed
        self.layouts = {k: Layout(c.tp, c.pp, c.dp, c.gpus) for k, c in cands.items()}
        self.tag = uuid.uuid4().hex[:8]  # group names of this run (and layout) never collide with another's

    # ------------------------------------------------------------------ validation
    def _spec_of(self, model: str) -> ModelSpec:
        return self.spec if model in ("actor", "reference") else self.spec.value_head()

    def _check_batches(self, name: str, stage: str, c: Candidate) -> None:
        w = self.workload
        rows = w.global_batch if stage != "generate" else w.prompts_per_step
        if stage == "generate":
            if w.global_batch % c.dp or w.prompts_per_step % c.dp:
                raise ValueError(f"model-stage {name}: dp={c.dp} must divide the rollouts "
                                 f"{w.global_batch} and prompts {w.prompts_per_step}")
            return
        if stage == "train":
            b = c.micro_batch or w.micro_batch_size
            if w.mini_batch_size % (c.dp * b):
                raise ValueError(f"model-stage {name}: dp={c.dp} x micro_batch={b} must divide "
                                 f"mini_batch_size={w.mini_batch_size} (dp*b*a = mini-batch)")
            a = w.mini_batch_size // (c.dp * b)
            if c.grad_accum and c.grad_accum != a:
                raise ValueError(f"model-stage {name}: dp*b*a = {c.dp}*{b}*{c.grad_accum} != "
                                 f"mini_batch_size={w.mini_batch_size}")
        elif rows % c.dp:
            raise ValueError(f"model-stage {name}: dp={c.dp} must divide the global batch {rows}")
        elif name == "reward.infer" and w.algorithm == "remax" and w.prompts_per_step % c.dp:
            raise ValueError(f"model-stage {name}: dp={c.dp} must divide the {w.prompts_per_step} greedy "
                             f"baseline rollouts of ReMax")

    # ------------------------------------------------------------------ lifecycle
    def start(self, pool: WorkerPool | None = None) -> RLDriver:
        """Build every model-stage's engines on ``pool`` (started here with ``num_workers`` if None).

        Raises:
            ValueError: the pool has fewer workers than the plan uses.
        """
        if pool is None:
            pool = WorkerPool(self.num_workers, self.cfg.timeout_s).start()
            self._own_pool = True
        if len(pool.workers) < self.num_workers:
            raise ValueError(f"worker pool has {len(pool.workers)} workers, the plan needs {self.num_workers}")
        self.pool, self.workers = pool, pool.workers
        return self.build_engines()

    def seed_of(self, model: str) -> int:
        """Initial-weights seed of ``model`` (the actor and reference start from the same weights)."""
        return {"actor": 0, "reference": 0, "critic": 1, "reward": 2}.get(model, 3) + self.cfg.seed * 10

    def storage_seeds(self) -> dict[str, int]:
        """model-stage → seed of the stored weights a Load from storage re-creates (frozen models)."""
        return {ms.name: self.seed_of(ms.model) for ms in self.wf.model_stages if not ms.trainable}

    def adam_config(self, model_stage: str) -> AdamConfig:
        return AdamConfig(lr=self.cfg.critic_lr if model_stage.startswith("critic.") else self.cfg.actor_lr)

    def recompute_of(self, model_stage: str) -> str:
        """Activation recomputation of a model-stage in the current plan (``auto`` → ``selective``)."""
        if not model_stage.endswith(".train"):
            return "none"
        rc = self.cands[model_stage].recompute
        return "selective" if rc == "auto" else rc

    def build_engines(self) -> RLDriver:
        """Build every model-stage's engines in the current layouts (frozen ones from their seeds)."""
        self.publish_precision()
        if self.cfg.device_capacity:
            self._get([self.workers[i].set_capacity.remote(self.cfg.device_capacity)
                       for i in sorted({i for lay in self.layouts.values() for i in lay.workers})], "capacity")
        self.build_from_seeds("building")
        return vd.started(self)  # with --rollout vllm, actor.generate's vLLM engines (run/vllm_driver.py)

    def build_from_seeds(self, what: str) -> None:
        """Build every model-stage's engines in the current layouts from their seeds (``what``: label)."""
        for ms in self.wf.model_stages:
            lay, c = self.layouts[ms.name], self.cands[ms.name]
            adam = self.adam_config(ms.name) if ms.trainable else None
            self._get([self.workers[i].build.remote(ms.name, self._spec_of(ms.model), lay, self.seed_of(ms.model),
                                                    ms.trainable, adam, self.tag, recompute=self.recompute_of(ms.name),
                                                    precision=self.cfg.precision, zero=c.zero, offload=c.offload)
                       for i in lay.workers], f"{what} {ms.name}")

    def publish_precision(self) -> None:
        """Write the run's precision into the pool's TCPStore (``worker.PRECISION_KEY``), where workers
        that did not build a model-stage themselves (joiners in a live transition) read it."""
        store = getattr(getattr(self, "pool", None), "store", None)
        if store is not None:
            store.set(PRECISION_KEY, self.cfg.precision)

    def close(self) -> None:
        """Drop this run's engines (and stop the pool if this driver started it)."""
        vd.stop_vllm_engines(self, everything=True)  # vLLM engines stop first (none without --rollout vllm)
        if getattr(self, "_own_pool", False):
            self.pool.close()
        elif self.workers:
            try:
                self._get([w.destroy.remote(ms.name) for ms in self.wf.model_stages for w in self.workers
                           if w is not None],
                          "destroy", timeout=30)
            except WorkerFailure:
                pass
        self.workers = []

    def _get(self, futures, what: str, timeout: float | None = None):
        """Results of remote calls; with a pool, dead or hung workers are detected (``WorkerLost``)."""
        pool = getattr(self, "pool", None)
        if pool is not None and hasattr(pool, "get"):
            return pool.get(futures, what, timeout or 4 * self.cfg.timeout_s)
        return _ray_get(futures, what, timeout or 4 * self.cfg.timeout_s)

    # ------------------------------------------------------------------ model-stage calls
    def _submit(self, name: str, method: str, rows: list[torch.Tensor | list], *args, out_at="last"):
        """Submit ``method(name, replica rows..., *args)`` to every worker of ``name`` (no wait).

        Calls submitted before a :meth:`_collect` may share workers: each Ray actor runs its calls in
        submission order, one global order, so collectives of different model-stages never cross-wait.
        """
        lay = self.layouts[name]
        futs, pick = [], []
        for d in range(lay.dp):
            share = [r.chunk(lay.dp)[d] if isinstance(r, torch.Tensor) else
                     r[d * len(r) // lay.dp:(d + 1) * len(r) // lay.dp] for r in rows]
            for p in range(lay.pp):
                for t in range(lay.tp):
                    w = lay.worker(d, p, t)
                    if self.workers[w] is None:
                        raise WorkerFailure(f"{name}.{method}: worker {w} has left the pool; replan without it")
                    futs.append(getattr(self.workers[w], method).remote(name, *share, *args))
                    pick.append(t == 0 and p == (lay.pp - 1 if out_at == "last" else 0))
        return name, method, futs, pick

    def _collect(self, pending) -> list:
        """Outputs per replica (from the last PP rank's, or the first's, TP rank 0) of a submission."""
        name, method, futs, pick = pending
        res = self._get(futs, f"{name}.{method}")
        return [r for r, k in zip(res, pick) if k]

    def _per_replica(self, name: str, method: str, rows: list[torch.Tensor | list], *args, out_at="last"):
        return self._collect(self._submit(name, method, rows, *args, out_at=out_at))

    def _infer_mb(self, name: str, rows: int | None = None) -> int:
        """Forward micro-batch of ``name``: the candidate's (or the workload's) b, lowered to divide
        the replica's share of ``rows`` (default: the global batch)."""
        c, lay = self.cands[name], self.layouts[name]
        rows = self.workload.global_batch if rows is None else rows
        return _largest_divisor(rows // lay.dp, c.micro_batch or self.workload.infer_micro_batch_size)

    def _generate(self, prompts: torch.Tensor, seeds: list[int], greedy: bool) -> torch.Tensor:
        out = self._per_replica("actor.generate", "generate", [prompts, seeds], self.R, self.cfg.temperature,
                                greedy, self.task.tokenizer.eos_id, self.task.tokenizer.pad_id,
                                self.cands["actor.generate"].concurrency, out_at="first")
        return vd.rollout_tokens(self, out, greedy)  # vLLM engines also answer their log-probs

    def _submit_scores(self, tokens: torch.Tensor, P: int):
        if "reward.infer" in self.layouts:
            return self._submit("reward.infer", "values", [tokens], P,
                                self._infer_mb("reward.infer", tokens.shape[0]))
        return None

    def _scores(self, pending, indices: list[int], tokens: torch.Tensor, mask: torch.Tensor, P: int,
                task=None) -> torch.Tensor:
        """Reward-model scores (value at the last response token) or, without one, the rule of
        ``task`` (default: the driver's)."""
        if pending is not None:
            v = torch.cat(self._collect(pending))
            last = mask.sum(1).long() - 1
            return v[torch.arange(v.shape[0]), last].detach()
        return (task or self.task).rewards(indices, tokens[:, P:])

    # ------------------------------------------------------------------ one step
    def step(self) -> dict:
        """One synchronous RL step; returns its metrics (rewards, losses, KL, seconds)."""
        w, cfg = self.workload, self.cfg
        t0 = time.perf_counter()
        n, Pn = w.samples_per_prompt, w.prompts_per_step
        prompts, idx = self.task.prompts(self.step_index * Pn, Pn)
        rep = prompts.repeat_interleave(n, 0)
        rep_idx = [i for i in idx for _ in range(n)]
        seeds = [_seed(cfg.seed, i, j, "sample") for i in idx for j in range(n)]
        resp = self._generate(rep, seeds, greedy=False)
        batch, kl_in_loss, metrics = self.experience(
            prompts, idx, rep, rep_idx, resp, self.task,
            lambda: self._generate(prompts, [0] * Pn, greedy=True))
        metrics.update(self._train(batch, prompts.shape[1], kl_in_loss))
        metrics.update(vd.step_metrics(self, batch, self._sync()))  # vLLM: engine log-probs vs actor.infer's
        self.step_index += 1
        metrics["seconds"] = time.perf_counter() - t0
        return metrics

    def experience(self, prompts: torch.Tensor, idx: list[int], rep: torch.Tensor, rep_idx: list[int],
                   resp: torch.Tensor, task, greedy_responses) -> tuple[dict, float, dict]:
        """The inference stage, rewards and advantages of one batch of rollouts (shared by the
        synchronous and the asynchronous driver).

        Args:
            prompts: [P_n, P] prompt tokens; ``rep``: [P_n·n, P] each repeated ``n`` times, with their
                dataset indices ``idx`` / ``rep_idx``; ``resp``: [P_n·n, R] sampled responses.
            task: the task whose rule rewards and tokenizer the batch was generated with.
            greedy_responses: ReMax only, a callable giving the [P_n, R] greedy responses (the
                baseline); called after the inference stage.

        Returns:
            ``(batch, kl_in_loss, metrics)``: the training batch (tokens, mask, old_logp, ref_logp, adv,
            and PPO's old_values and returns), the KL coefficient the loss carries (GRPO), and the
            step's reward, score, response length and KL.
        """
        cfg, alg_name, n = self.cfg, self.workload.algorithm, self.workload.samples_per_prompt
        P = prompts.shape[1]
        tokens = torch.cat([rep, resp], 1)
        mask = response_mask(resp, task.tokenizer.eos_id)
        task_reward = task.rewards(rep_idx, resp)
        # the inference stage: its model-stages are submitted together and run concurrently
        pend_rm = self._submit_scores(tokens, P)
        pend_old = self._submit("actor.infer", "logprobs", [tokens], P, self._infer_mb("actor.infer"),
                                cfg.temperature)
        pend_ref = (self._submit("reference.infer", "logprobs", [tokens], P, self._infer_mb("reference.infer"),
                                 cfg.temperature) if (has_ref := "reference.infer" in self.layouts) else None)
        pend_val = (self._submit("critic.infer", "values", [tokens], P, self._infer_mb("critic.infer"))
                    if alg_name == "ppo" else None)
        scores = self._scores(pend_rm, rep_idx, tokens, mask, P, task)
        old_logp = torch.cat(self._collect(pend_old))
        ref_logp = torch.cat(self._collect(pend_ref)) if has_ref else old_logp  # no reference: kl_coef 0, no KL
        batch = {"tokens": tokens, "mask": mask, "old_logp": old_logp, "ref_logp": ref_logp}
        kl_in_loss = 0.0
        if alg_name == "ppo":
            values = torch.cat(self._collect(pend_val))
            r = alg.token_rewards(scores, old_logp, ref_logp, mask, cfg.kl_coef)
            adv, ret = alg.gae(r, values, mask, cfg.gamma, cfg.lam)
            batch.update(adv=alg.masked_whiten(adv, mask), old_values=values, returns=ret)
        elif alg_name == "grpo":
            batch["adv"] = alg.grpo_advantages(scores, n, mask)
            kl_in_loss = cfg.kl_coef
        else:  # remax: greedy rollout per prompt is the baseline
            g_resp = greedy_responses()
            g_tok = torch.cat([prompts, g_resp], 1)
            g_scores = self._scores(self._submit_scores(g_tok, P), idx, g_tok,
                                    response_mask(g_resp, task.tokenizer.eos_id), P, task)
            r = alg.token_rewards(scores, old_logp, ref_logp, mask, cfg.kl_coef)
            batch["adv"] = alg.remax_advantages(r, g_scores.repeat_interleave(n), mask)
        metrics = {"step": self.step_index, "reward": float(task_reward.mean()), "score": float(scores.mean()),
                   "response_len": float(mask.sum(1).mean()),
                   **({"kl": float(((old_logp - ref_logp) * mask).sum() / mask.sum())} if has_ref else {})}
        return batch, kl_in_loss, metrics

    def _train(self, batch: dict, P: int, kl_in_loss: float) -> dict:
        w, cfg = self.workload, self.cfg
        actor_loss = {"kind": "actor", "prompt_len": P, "clip": cfg.clip, "kl_coef": kl_in_loss,
                      "temperature": cfg.temperature}
        critic_loss = {"kind": "critic", "prompt_len": P, "clip": cfg.value_clip}
        sums = {"actor_loss": 0.0, "critic_loss": 0.0}
        mb, per_epoch = w.mini_batch_size, w.global_batch // w.mini_batch_size
        n, base = w.ppo_epochs * per_epoch, self.updates
        jobs = [("actor.train", actor_loss, "actor_loss")]
        if "critic.train" in self.layouts:
            jobs.append(("critic.train", critic_loss, "critic_loss"))
        pending = []
        # each model's updates in a row, all submitted before any is collected: disjoint, actor and critic run concurrently
        for name, loss, key in jobs:
            for i in range(n):
                k = i % per_epoch
                sub = {f: v[k * mb:(k + 1) * mb] for f, v in batch.items()}
                pending.append((key, self._submit(name, "train_fields", [sub[f] for f in sorted(sub)], sorted(sub),
                                                  loss, self.cands[name].micro_batch or w.micro_batch_size,
                                                  float(sub["mask"].sum()), base + i + 1)))
        self.updates = base + n
        for key, pend in pending:
            sums[key] += sum(r["loss"] for r in self._collect(pend))
        return {k: v / n for k, v in sums.items() if k != "critic_loss" or "critic.train" in self.layouts}

    def _sync(self) -> dict:
        """The per-step weight sync from each training layout to the model's other layouts
        (rank-aligned, ``WorkerCore.sync_weights``).

        Returns:
            ``{"sent", "recv"}``: parameter bytes summed over workers (also kept as ``last_sync``).
        """
        futs = []
        # the critic first: colocated, its trained state is the one resident after the updates
        for src, dsts in (("critic.train", ("critic.infer",)), ("actor.train", ("actor.generate", "actor.infer"))):
            for dst in dsts:
                if src in self.layouts and dst in self.layouts:
                    sl, dl = self.layouts[src], self.layouts[dst]
                    members = sorted(set(sl.workers if self.cands[src].zero == 3 else sl.replica(0)) | set(dl.workers))
                    spec = self._spec_of(src.split(".")[0])
                    futs += [self.workers[m].sync_weights.remote(src, dst, sl, dl, spec, self.updates, self.tag)
                             for m in members]
        res = self._get(futs, "weight sync")
        self.last_sync = {k: sum(r[k] for r in res) for k in ("sent", "recv")}
        return vd.note_sync(self, res)  # also what the pushes into vLLM engines moved

    # ------------------------------------------------------------------ checks and measurements
    def gather_logical_state(self, model_stage: str, replica: int = 0) -> dict:
        """Full unsharded state of one replica of ``model_stage`` (see ``Engine.gather_logical_state``)."""
        lay = self.layouts[model_stage]
        # a ZeRO engine all-gathers its optimizer slices over DP: every replica takes part
        ids = lay.workers if self.cands[model_stage].zero else lay.replica(replica)
        res = self._get([self.workers[i].gather_logical_state.remote(model_stage) for i in ids],
                        f"gather {model_stage}")
        return res[list(ids).index(lay.replica(replica)[0])]

    def measurements(self) -> dict:
        """What the controller calibrates from, over all workers since the last reset.

        Returns:
            ``stage_seconds`` {model-stage: wall s} (max over workers), ``op_seconds`` {op class: s}
            (summed over workers), ``op_seconds_by_stage`` {model-stage: {op class: s}} (max over
            workers: the slowest rank), ``peak_bytes`` and ``peak_bytes_by_stage`` (max over workers),
            ``bytes_sent`` and ``op_bytes`` {op class: bytes} (sums), ``memory`` (offload/restore bytes, seconds and counts summed over
            workers, ``worker/memory_pool.py``) and ``per_worker`` (each worker's own numbers).
        """
        per = self._get([wk.measurements.remote() for wk in self.workers if wk is not None], "measurements")
        stage, ops, by_stage, peaks = {}, {}, {}, {}
        for m in per:
            for k, v in m["stage_seconds"].items():
                stage[k] = max(stage.get(k, 0.0), v)
            for k, v in m["op_seconds"].items():
                ops[k] = ops.get(k, 0.0) + v
            for ms, d in m["op_seconds_by_stage"].items():
                for k, v in d.items():
                    by_stage.setdefault(ms, {})[k] = max(by_stage.get(ms, {}).get(k, 0.0), v)
            for ms, v in m["peak_bytes_by_stage"].items():
                peaks[ms] = max(peaks.get(ms, 0), v)
        op_bytes: dict[str, float] = {}
        for m in per:
            for k, v in m.get("op_bytes", {}).items():
                op_bytes[k] = op_bytes.get(k, 0.0) + v
        memory = {k: sum(m["memory"].get(k, 0) for m in per) for k in MOVE_KEYS}
        return {"stage_seconds": stage, "op_seconds": ops, "op_seconds_by_stage": by_stage,
                "peak_bytes": max(m["peak_bytes"] for m in per), "peak_bytes_by_stage": peaks,
                "bytes_sent": sum(m["bytes_sent"] for m in per), "op_bytes": op_bytes, "memory": memory,
                "per_worker": per}

    def step_report(self, metrics: dict):
        """A ``nereus.controller.monitor.StepReport`` for the step ``metrics`` came from, built from the
        measurements since the last :meth:`reset_measurements` (call that before each step)."""
        from nereus.controller.monitor import StepReport

        m = self.measurements()
        return StepReport(step=int(metrics["step"]), response_len=max(float(metrics["response_len"]), 1e-9),
                          pool=frozenset(i for i, w in enumerate(self.workers) if w is not None),
                          step_time=float(metrics["seconds"]), op_seconds=m["op_seconds_by_stage"],
                          peak_memory={k: float(v) for k, v in m["peak_bytes_by_stage"].items()})

    def reset_measurements(self) -> None:
        self._get([wk.reset_measurements.remote() for wk in self.workers if wk is not None], "reset measurements")

