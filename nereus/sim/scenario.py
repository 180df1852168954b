"""A simulation scenario as plain data, and running its policies (in worker processes when asked).

:class:`Scenario` holds names and numbers only, so it pickles to worker processes; each worker
rebuilds the job, traces and simulated cluster from it and runs one policy. Every policy sees the
same hidden truth, congestion events and noise seed.
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

from nereus.sim.cluster import SimulatedCluster, Truth
from nereus.sim.growth import growth_scenario
from nereus.sim.policies import make_policy
from nereus.sim.restart import RestartCost
from nereus.sim.run import RunResult, simulate
from nereus.sim.traces import (
    DEFAULT_TRACE,
    AvailabilityTrace,
    LengthTrace,
    load_availability,
    load_response_lengths,
)
from nereus.spec.framework import get_framework
from nereus.spec.hardware import ClusterSpec, get_gpu
from nereus.spec.job import JobSpec
from nereus.spec.presets import get_model
from nereus.spec.workload import WorkloadSpec

__all__ = ["Scenario", "run_scenario", "DEFAULT_POLICIES", "DEFAULT_GAMMAS"]

DEFAULT_GAMMAS = (0.0, 0.25, 1.0)
DEFAULT_POLICIES = ("nereus", "nereus-paper", "static", "elastic", "elastic-oracle", "replan-all",
                    "uncalibrated") + tuple(
    f"gamma={g:g}" for g in DEFAULT_GAMMAS)


@dataclass(frozen=True)
class Scenario:
    """Everything a run needs, as names and numbers.

    Attributes:
        model, algo, gpu, nodes, gpus_per_node: the job and cluster.
        trace: a shipped trace name or a path; scaled to ``nodes · gpus_per_node`` GPUs.
        length_trace: a verl CSV path, or None for the SYNTHETIC growth scenario.
        growth: (start tokens, end tokens, over steps) of the synthetic scenario.
        hours: simulated hours (None: the trace's length).
        gamma: γ of the ``nereus``, ``replan-all`` and ``uncalibrated`` policies.
        seed: noise, congestion and length-noise seed.
        time_unit: for two-column count traces (None: guessed).
        truth: hidden costs (:class:`~nereus.sim.cluster.Truth`).
        restart: checkpoint/restart costs.
        first_horizon: ``H_x`` at a signal's first crossing for the controller policies not named
            ``paper`` (``elapsed`` or ``one``; ``nereus.controller.horizon``).
        start: hours into the trace where the run starts (the window is scaled to the cluster).
        length_scale: ``(mode, tokens)`` for a length trace: ``none``, or scale it so its ``mean``
            or ``max`` is ``tokens`` (:meth:`~nereus.sim.traces.LengthTrace.normalized`).
        prompts_per_step, samples_per_prompt, mini_batch: the RL batch (global batch =
            prompts · samples; ``mini_batch`` must divide it).
        asynchronous: one-step-off asynchronous RL (generation on GPUs of its own; the step is
            ``max(generate, infer + train)``).
        framework: preset name of what the training framework supports (the plan space;
            :mod:`nereus.spec.framework`).
    """

    model: str = "llama-3.1-8b"
    algo: str = "ppo"
    gpu: str = "h100"
    nodes: int = 4
    gpus_per_node: int = 8
    trace: str = DEFAULT_TRACE
    length_trace: str | None = None
    growth: tuple[float, float, int] = (500.0, 8000.0, 1000)
    hours: float | None = None
    gamma: float = 0.5
    seed: int = 0
    time_unit: str | None = None
    truth: Truth = field(default_factory=Truth)
    restart: RestartCost = field(default_factory=RestartCost)
    first_horizon: str = "elapsed"
    start: float = 0.0
    length_scale: tuple[str, float] = ("max", 8000.0)
    prompts_per_step: int = 256
    samples_per_prompt: int = 4
    mini_batch: int = 256
    asynchronous: bool = False
    framework: str = "nereus"

    def job(self) -> JobSpec:
        w = WorkloadSpec(algorithm=self.algo, response_len=int(self.growth[0]), prompts_per_step=self.prompts_per_step,
                         samples_per_prompt=self.samples_per_prompt, mini_batch_size=self.mini_batch,
                         asynchronous=self.asynchronous)
        return JobSpec(get_model(self.model), ClusterSpec(get_gpu(self.gpu), self.nodes, self.gpus_per_node), w,
                       framework=get_framework(self.framework))

    def availability(self) -> AvailabilityTrace:
        """The trace's window ``[start, start + hours)`` scaled so the window's maximum is the cluster."""
        tr = load_availability(self.trace, self.time_unit)
        tr = tr.window(self.start, self.hours)
        return tr.scaled(self.nodes * self.gpus_per_node)

    def duration_hours(self) -> float:
        return self.hours if self.hours else self.availability().end / 3600.0

    def lengths(self) -> LengthTrace:
        if self.length_trace:
            mode, tokens = self.length_scale
            return load_response_lengths(self.length_trace).normalized(mode, tokens)
        start, end, over = self.growth
        return growth_scenario(20000, start=start, end=end, over_steps=int(over), seed=self.seed)

    def validate(self) -> None:
        """Build everything once so bad input fails before workers start (raises ValueError)."""
        if self.hours is not None and not self.hours > 0:
            raise ValueError(f"--hours must be > 0 simulated hours (0 on the command line: the whole trace), "
                             f"got {self.hours!r}")
        self.job()
        self.availability()
        self.lengths()


def run_policy(scenario: Scenario, name: str, progress=None) -> RunResult:
    """Run one policy of ``scenario``; ``progress(t_seconds)`` is called as simulated time advances."""
    job = scenario.job()
    hours = scenario.duration_hours()
    cluster = SimulatedCluster(job, scenario.availability(), scenario.lengths(), scenario.truth,
                               seed=scenario.seed, hours=hours)
    end = hours * 3600.0

    def future(gpus, t):
        return max(0.0, min(cluster.loss_time(gpus, t), end) - t)
    policy = make_policy(name, job, scenario.gamma, scenario.truth.table(), scenario.truth.memory_factor,
                         scenario.restart, future=future, first_horizon=scenario.first_horizon)
    return simulate(policy, cluster, hours, scenario.restart, progress=progress)


def _worker(scenario: Scenario, name: str, queue) -> RunResult:
    last = [0.0]
    step = scenario.duration_hours() * 36.0  # report every 1% of the run

    def progress(t):
        if t - last[0] >= step:
            last[0] = t
            queue.put((name, t))
    res = run_policy(scenario, name, progress)
    queue.put((name, scenario.duration_hours() * 3600.0))
    return res


def run_scenario(scenario: Scenario, policies, jobs: int | None = None, on_progress=None) -> dict:
    """Run ``policies`` (names) on ``scenario``; returns name → :class:`RunResult` in input order.

    Args:
        jobs: worker processes (default: min(#policies, CPU count)); 1 runs in this process.
        on_progress: ``(policy, t_seconds)`` callback.
    """
    scenario.validate()
    policies = list(policies)
    jobs = jobs or min(len(policies), os.cpu_count() or 1)
    results: dict = {}
    if jobs <= 1:
        for name in policies:
            results[name] = run_policy(scenario, name, (lambda t, n=name: on_progress(n, t)) if on_progress else None)
        return results
    import multiprocessing as mp
    import queue as _queue

    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        q = manager.Queue()
        with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as ex:
            futs = {ex.submit(_worker, scenario, name, q): name for name in policies}
            pending = set(futs)
            while pending:
                try:
                    name, t = q.get(timeout=0.2)
                    if on_progress:
                        on_progress(name, t)
                except _queue.Empty:
                    pass
                for f in [f for f in pending if f.done()]:
                    pending.discard(f)
                    results[futs[f]] = f.result()
    return {n: results[n] for n in policies}
