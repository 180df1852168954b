"""One-step-off asynchronous RL on the Ray runtime (``nereus run --async``; docs/runtime.md "Asynchronous RL").

:class:`AsyncRLDriver` subclasses :class:`~nereus.runtime.run.driver.RLDriver` and leaves its synchronous
``step`` untouched. Weight versions count completed steps: the training weights of step ``k`` are
``v(k)``, and the weight sync that ends step ``k`` moves ``v(k+1)`` into ``actor.generate``. With
staleness ``N`` (default 1), step ``k``:

1. issues generation of batch ``k+N`` (prompts ``(k+N)·P .. (k+N+1)·P-1``) on the ``actor.generate``
   workers, which hold ``v(k)``; batches ``0..N-1`` are issued at step 0 and trained on ``v(0)`` samples
   (the warm-up: no older weights exist). Each generating call also returns the generating policy's
   log-probs of its samples (behaviour log-probs, computed by the generation engine right after
   sampling, as a rollout engine returns them) and the engine's ``policy_version``;
2. collects batch ``k`` (generated earlier with ``v(k-N)``) and runs inference, advantages and training
   on it exactly as the synchronous step does, while the generation of step 1 runs on its own workers;
3. completes every generation issued so far (waits for it: the *drain*), then runs the weight sync.
   Nothing is in flight at the sync, so it is the safe boundary where a live transition
   (``--adaptive``) may change the layouts: queued batches are tensors on the driver, independent of
   any layout, so a transition neither skips nor repeats a sample; the in-flight generation is
   **completed**, never aborted, and its cost is the drain time (``drain_s`` per step).

Off-policy correction (the decoupled PPO objective; verl's truncated importance sampling): for a
batch generated with older weights, ``actor.infer`` log-probs under ``v(k)`` are the proximal policy
of the clipped ratio, and each token's advantage is multiplied by
``min(exp(logp_prox - logp_behaviour), is_cap)``. The clipped surrogate is linear in a positive
advantage weight, so this is exactly ``w · max(-r·A, -clip(r)·A)`` without changing the loss.
Batches generated with the training weights (staleness 0, the warm-up step) get no weight at all, so
staleness 0 reproduces :meth:`RLDriver.step` exactly.

Generation must run on workers of its own: with staleness >= 1 a plan whose ``actor.generate``
workers are also used by another model-stage is refused at :meth:`AsyncRLDriver.start` (each Ray
worker runs its calls in order, so nothing would overlap); a transition that makes them overlap
later falls back to synchronous steps (``mode="sync-fallback"``) until a plan separates them again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from nereus.runtime.run.adaptive import AdaptiveRun
from nereus.runtime.run.config import RLConfig
from nereus.runtime.run.driver import RLDriver, _largest_divisor, _seed
from nereus.spec.model import ModelSpec
from nereus.spec.plan import Candidate, Plan
from nereus.spec.workload import WorkloadSpec

__all__ = ["AsyncRLDriver", "GenBatch", "async_plan", "overlap_of", "generate_scored", "AsyncAdaptiveRun"]


def generate_scored(core, model_stage: str, prompts: torch.Tensor, seeds: list[int], max_new_tokens: int,
                    temperature: float, greedy: bool, eos_id: int, pad_id: int, concurrency: int,
                    logprob_micro_batch: int):
    """Run on a worker (``actor.__ray_call__``): generate, then (``logprob_micro_batch > 0``) the same
    engine's log-probs of the sampled tokens, and the engine's ``policy_version``.

    Returns:
        ``(responses [B, R], behaviour log-probs [B, R] or None, policy_version)``; log-probs are
        None off the last PP rank.
    """
    resp = core.generate(model_stage, prompts, seeds, max_new_tokens, temperature, greedy, eos_id, pad_id,
                         concurrency)
    logp = None
    if logprob_micro_batch > 0:
        tokens = torch.cat([prompts, resp], 1)
        logp = core.logprobs(model_stage, tokens, prompts.shape[1], logprob_micro_batch, temperature)
    return resp, logp, int(core._engine(model_stage).policy_version)


@dataclass
class GenBatch:
    """The rollouts of one training step, generated ahead of it.

    Attributes:
        step: the training step it is for; ``version``: the generating weights' version (steps
            completed when it was generated); ``policy_version``: the generation engine's own
            counter (optimizer updates at its last weight sync), as reported by the worker.
    """

    step: int
    version: int
    prompts: torch.Tensor
    idx: list[int]
    rep: torch.Tensor
    rep_idx: list[int]
    task: object
    pending: tuple | None = None
    greedy_pending: tuple | None = None
    resp: torch.Tensor | None = None
    behav_logp: torch.Tensor | None = None
    g_resp: torch.Tensor | None = None
    policy_version: int = -1
    issued_at: float = 0.0
    done_at: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def ready(self) -> bool:
        return self.resp is not None


def overlap_of(layouts: dict) -> list[int]:
    """Workers of ``actor.generate`` that another model-stage also uses (sorted)."""
    gen = set(layouts["actor.generate"].workers)
    others = set()
    for name, lay in layouts.items():
        if name != "actor.generate":
            others |= set(lay.workers)
    return sorted(gen & others)


def async_plan(workload: WorkloadSpec, layouts: dict[str, tuple[int, int, int]], num_workers: int,
               micro_batch: int = 0) -> Plan:
    """A plan with ``actor.generate`` on the *last* workers and every other model-stage placed
    round-robin (within its stage) on the workers before them, so generation has workers of its own.

    Raises:
        ValueError: a missing model-stage, or more workers needed than given (naming both counts).
    """
    from nereus.workflow import workflow_for

    wf = workflow_for(workload)
    missing = [m.name for m in wf.model_stages if m.name not in layouts]
    if missing:
        raise ValueError(f"layouts lack model-stage(s) {missing}; the {wf.algorithm} workflow needs "
                         f"{[m.name for m in wf.model_stages]}")
    tp, pp, dp = layouts["actor.generate"]
    g = tp * pp * dp
    rest = num_workers - g
    need = max(a * b * c for n, (a, b, c) in layouts.items() if n != "actor.generate" and n in
               {m.name for m in wf.model_stages})
    if rest < need:
        raise ValueError(f"--async needs actor.generate on workers of its own: it takes {g} worker(s) and the "
                         f"largest other model-stage {need}, {g + need} in all, but only {num_workers} are given; "
                         f"use more --workers or smaller --layout degrees")
    cands, offset = [], {}
    for ms in wf.model_stages:
        tp, pp, dp = layouts[ms.name]
        n = tp * pp * dp
        if ms.name == "actor.generate":
            gpus = tuple(range(rest, num_workers))
        else:
            o = offset.get(ms.stage, 0)
            gpus = tuple((o + i) % rest for i in range(n))
            offset[ms.stage] = (o + n) % rest
        cands.append(Candidate(ms.name, tp, pp, dp, micro_batch=micro_batch if ms.stage != "generate" else 0,
                               gpus=gpus))
    return Plan(candidates=tuple(cands))


class AsyncRLDriver(RLDriver):
    """:class:`RLDriver` with one-step-off (staleness-bounded) asynchronous steps (module docstring).

    Args:
        staleness: N >= 0; batch ``k`` is generated with ``v(max(0, k-N))``.
        is_cap: cap of the truncated importance weight (verl's ``tis_imp_ratio_cap`` is 2).
        on_overlap: ``"refuse"`` (ValueError at :meth:`start` when generation shares workers and
            N >= 1) or ``"sync"`` (run synchronous steps while they overlap, and say so in ``notes``).

    Attributes:
        sample_log: one record per trained sample: ``step, prompt, sample, gen_version,
            gen_policy_version, train_version, train_policy_version``.
        notes: what the driver decided (fallbacks), for the run's log.
    """

    def __init__(self, spec: ModelSpec, workload: WorkloadSpec, plan: Plan, task, num_workers: int,
                 cfg: RLConfig | None = None, staleness: int = 1, is_cap: float = 2.0,
                 on_overlap: str = "refuse") -> None:
        if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
            raise ValueError(f"staleness must be an integer >= 0, got {staleness!r}")
        if not is_cap >= 1.0:
            raise ValueError(f"is_cap must be >= 1, got {is_cap}")
        if on_overlap not in ("refuse", "sync"):
            raise ValueError(f"on_overlap must be 'refuse' or 'sync', got {on_overlap!r}")
        self.staleness, self.is_cap, self.on_overlap = staleness, float(is_cap), on_overlap
        self.queue: dict[int, GenBatch] = {}
        self.sample_log: list[dict] = []
        self.notes: list[str] = []
        self.gen_version = 0
        self._next_step = 0
        super().__init__(spec, replace(workload, asynchronous=staleness > 0), plan, task, num_workers, cfg)

    # ------------------------------------------------------------------ plan checks
    def set_plan(self, plan: Plan) -> None:
        super().set_plan(plan)
        self.overlap = overlap_of(self.layouts)
        if self.overlap and self.staleness > 0 and getattr(self, "workers", None):
            self.notes.append(f"plan shares workers {self.overlap} between actor.generate and other model-stages: "
                              "synchronous steps until a plan separates them")

    @property
    def asynchronous(self) -> bool:
        """Whether the next step overlaps generation with training."""
        return self.staleness > 0 and not self.overlap

    def start(self, pool=None):
        if self.overlap and self.staleness > 0 and self.on_overlap == "refuse":
            raise ValueError(f"--async: actor.generate runs on workers {self.overlap} that other model-stages "
                             f"also use ({self._users(self.overlap)}); asynchronous generation needs workers of "
                             "its own (a Ray worker runs its calls one at a time, so nothing would overlap). Give "
                             "generation separate workers (nereus.runtime.run.async_driver.async_plan) or use "
                             "--staleness 0 (synchronous)")
        if self.overlap and self.staleness > 0:
            self.notes.append(f"actor.generate shares workers {self.overlap}: synchronous steps (sync-fallback)")
        return super().start(pool)

    def _users(self, workers) -> str:
        return ", ".join(f"{n} on {sorted(set(lay.workers) & set(workers))}" for n, lay in self.layouts.items()
                         if n != "actor.generate" and set(lay.workers) & set(workers))

    # ------------------------------------------------------------------ generation ahead of training
    def _issue(self, j: int) -> GenBatch:
        """Submit generation of batch ``j`` on ``actor.generate`` (no wait)."""
        w, cfg = self.workload, self.cfg
        n, Pn = w.samples_per_prompt, w.prompts_per_step
        prompts, idx = self.task.prompts(j * Pn, Pn)
        rep = prompts.repeat_interleave(n, 0)
        rep_idx = [i for i in idx for _ in range(n)]
        seeds = [_seed(cfg.seed, i, s, "sample") for i in idx for s in range(n)]
        gb = GenBatch(step=j, version=self.gen_version, prompts=prompts, idx=idx, rep=rep, rep_idx=rep_idx,
                      task=self.task, issued_at=time.perf_counter())
        scored = j > self.step_index  # trains on newer weights: the behaviour log-probs are needed
        lay = self.layouts["actor.generate"]
        mb = _largest_divisor(rep.shape[0] // lay.dp, w.infer_micro_batch_size) if scored else 0
        gb.pending = self._submit_gen(rep, seeds, False, mb)
        if w.algorithm == "remax":  # the greedy baseline, by the same generating weights
            gb.greedy_pending = self._submit_gen(prompts, [0] * Pn, True, 0)
        self.queue[j] = gb
        return gb

    def _submit_gen(self, prompts: torch.Tensor, seeds: list[int], greedy: bool, mb: int):
        lay = self.layouts["actor.generate"]
        tok = self.task.tokenizer
        conc = self.cands["actor.generate"].concurrency
        futs, pick = [], []
        for d in range(lay.dp):
            share = prompts.chunk(lay.dp)[d]
            sd = seeds[d * len(seeds) // lay.dp:(d + 1) * len(seeds) // lay.dp]
            for p in range(lay.pp):
                for t in range(lay.tp):
                    wk = self.workers[lay.worker(d, p, t)]
                    futs.append(wk.__ray_call__.remote(generate_scored, "actor.generate", share, sd, self.R,
                                                       self.cfg.temperature, greedy, tok.eos_id, tok.pad_id,
                                                       conc, mb))
                    pick.append(t == 0 and p == lay.pp - 1)
        return "actor.generate", "generate", futs, pick

    def _complete(self, gb: GenBatch) -> GenBatch:
        """Wait for ``gb``'s generation and keep its tensors on the driver."""
        if gb.ready:
            return gb
        out = self._collect(gb.pending)
        gb.resp = torch.cat([r for r, _, _ in out])
        gb.policy_version = out[0][2]
        if out[0][1] is not None:
            gb.behav_logp = torch.cat([lp for _, lp, _ in out])
        if gb.greedy_pending is not None:
            gb.g_resp = torch.cat([r for r, _, _ in self._collect(gb.greedy_pending)])
        gb.pending = gb.greedy_pending = None
        gb.done_at = time.perf_counter()
        return gb

    # ------------------------------------------------------------------ one step
    def step(self) -> dict:
        """One asynchronous step (module docstring); metrics as :meth:`RLDriver.step` plus ``gen_version``,
        ``train_version``, ``staleness``, ``mode``, ``gen_wait_s``, ``drain_s``, ``sync_s`` and the
        importance weights' mean and max."""
        k = self.step_index
        if k != self._next_step:  # rewound (a restore from a checkpoint): queued rollouts are void
            self.queue.clear()
            self.gen_version = k
            self.notes.append(f"step index moved to {k}: queued generation dropped, re-issued with the restored "
                              "weights")
        t0 = time.perf_counter()
        try:
            if k not in self.queue:
                self._issue(k)
            if self.asynchronous:
                for j in range(k + 1, k + self.staleness + 1):
                    if j not in self.queue:
                        self._issue(j)
            gb = self._complete(self.queue[k])
            t_gen = time.perf_counter()
            metrics = self._train_on(gb)
            t_train = time.perf_counter()
            for j in sorted(self.queue):  # complete in-flight generation: the sync moves weights into its engines
                self._complete(self.queue[j])
            t_drain = time.perf_counter()
            self._sync()
        except Exception:
            for j in [j for j, b in self.queue.items() if not b.ready]:
                del self.queue[j]  # their futures may name a lost worker; re-issued on the retry
            raise
        t_end = time.perf_counter()
        del self.queue[k]
        self.step_index += 1
        self._next_step = self.step_index
        self.gen_version = self.step_index
        metrics.update(mode="async" if self.asynchronous else ("sync" if self.staleness == 0 else "sync-fallback"),
                       gen_wait_s=t_gen - t0, train_s=t_train - t_gen, drain_s=t_drain - t_train,
                       sync_s=t_end - t_drain, seconds=t_end - t0)
        return metrics

    def _train_on(self, gb: GenBatch) -> dict:
        """Inference, advantages and training of step ``k`` on ``gb`` (as :meth:`RLDriver.step`)."""
        k, n = self.step_index, self.workload.samples_per_prompt
        batch, kl_in_loss, metrics = self.experience(gb.prompts, gb.idx, gb.rep, gb.rep_idx, gb.resp, gb.task,
                                                     lambda: gb.g_resp)
        P, mask, old_logp = gb.prompts.shape[1], batch["mask"], batch["old_logp"]
        lag = k - gb.version
        iw = {}
        if lag > 0:  # off-policy: truncated importance weight against the generating policy
            if gb.behav_logp is None:
                raise RuntimeError(f"step {k}: batch generated with v({gb.version}) has no behaviour log-probs")
            ratio = torch.exp(old_logp - gb.behav_logp)
            wgt = torch.clamp(ratio, max=self.is_cap) * mask
            batch["adv"] = batch["adv"] * wgt
            m = mask.sum()
            iw = {"is_weight_mean": float(wgt.sum() / m), "is_weight_max": float((ratio * mask).max()),
                  "behaviour_kl": float(((gb.behav_logp - old_logp) * mask).sum() / m)}
        train_pv = self.updates
        metrics.update(self._train(batch, P, kl_in_loss))
        metrics.update(gen_version=gb.version, gen_policy_version=gb.policy_version, train_version=k,
                       staleness=lag, **iw)
        for s, i in enumerate(gb.rep_idx):
            self.sample_log.append({"step": k, "prompt": i, "sample": s % n, "gen_version": gb.version,
                                    "gen_policy_version": gb.policy_version, "train_version": k,
                                    "train_policy_version": train_pv})
        return metrics


# ---------------------------------------------------------------------- with --adaptive
class AsyncAdaptiveRun(AdaptiveRun):
    """``AdaptiveRun`` whose driver is an :class:`AsyncRLDriver` (the planner and cost model see an
    asynchronous workload, so generation gets GPUs of its own). Decisions are applied after the weight
    sync that ends each step, where nothing is in flight (module docstring); a plan that puts
    generation on shared workers runs synchronous steps (``on_overlap="sync"``), logged.

    """

    def __init__(self, spec: ModelSpec, workload: WorkloadSpec, *args, staleness: int = 1, **kw) -> None:
        super().__init__(spec, replace(workload, asynchronous=staleness > 0), *args, **kw)
        self.staleness = staleness

    def make_driver(self, spec, workload, plan, task, num_workers, cfg):
        return _LoggingAsyncDriver(spec, workload, plan, task, num_workers, cfg, staleness=self.staleness,
                                   on_overlap="sync", log=self.log)


class _LoggingAsyncDriver(AsyncRLDriver):
    """An :class:`AsyncRLDriver` that prints its notes (fallbacks) as they are made."""

    def __init__(self, *args, log=None, **kw) -> None:
        self._log = log or (lambda *a: None)
        super().__init__(*args, **kw)

    def step(self) -> dict:
        seen = len(self.notes)
        m = super().step()
        for note in self.notes[seen:]:
            self._log(f"  [async] {note}")
        self._log(f"  [async] step {m['step']}: trained v({m['train_version']}) on samples of "
                  f"v({m['gen_version']}) ({m['mode']}); generation wait {m['gen_wait_s']:.2f}s, drain "
                  f"{m['drain_s']:.2f}s, sync {m['sync_s']:.2f}s")
        return m
