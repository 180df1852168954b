"""What the Ray tests of live state movement share (``test_runtime_executor.py``,
``test_runtime_transit_zero.py``, ``test_runtime_transit_zero3.py``): the tiny PPO job on 4 workers,
plans written as layout tables, the gathered logical state of the training model-stages, its
bit-equality, and the fault-free reference run a chain of transitions must end at (the same samples,
no transition).

Not a test module: pytest puts ``tests/`` on ``sys.path`` for the modules that import it."""

from __future__ import annotations

import torch

from nereus.runtime.rl.task import DigitTask
from nereus.runtime.run.config import RLConfig
from nereus.runtime.run.driver import RLDriver
from nereus.spec.plan import Candidate, Plan
from nereus.spec.presets import MODEL_PRESETS
from nereus.spec.workload import WorkloadSpec

SPEC = MODEL_PRESETS["tiny"]
TASK = DigitTask("reverse", 3)
W = WorkloadSpec(algorithm="ppo", prompts_per_step=4, samples_per_prompt=2, prompt_len=5, response_len=4,
                 mini_batch_size=4, micro_batch_size=1, infer_micro_batch_size=4, reward_model=False)
CFG = RLConfig(actor_lr=1e-2, critic_lr=1e-2, timeout_s=30)
TRAIN = ("actor.train", "critic.train")
KINDS = ("params", "exp_avg", "exp_avg_sq")
COUNTERS = ("step", "update_count", "version", "policy_version", "position")


def layout_plan(base: dict, changes: dict, zero: int = 0) -> Plan:
    """``base`` ({model-stage: (tp, pp, dp, gpus)}) with ``changes`` applied (keys with ``_`` for
    ``.``: ``actor_train``); micro-batch 1 (0 for generation); the actor's training model-stage at
    ZeRO ``zero`` where its DP > 1."""
    lay = {**base, **{k.replace("_", "."): v for k, v in changes.items()}}
    return Plan(candidates=tuple(Candidate(ms, tp, pp, dp, micro_batch=1 if not ms.endswith("generate") else 0,
                                           gpus=gpus, zero=zero if ms == "actor.train" and dp > 1 else 0)
                                 for ms, (tp, pp, dp, gpus) in lay.items()))


def states(d: RLDriver) -> dict:
    """{model-stage: logical state} of the training model-stages, gathered through the driver."""
    return {n: d.gather_logical_state(n) for n in TRAIN}


def assert_equal(a: dict, b: dict, what: str, kinds=KINDS) -> None:
    """Every tensor of ``kinds`` bit-equal and every counter equal, per model-stage of ``a``."""
    for ms in a:
        for kind in kinds:
            assert a[ms][kind].keys() == b[ms][kind].keys()
            for n in a[ms][kind]:
                assert torch.equal(a[ms][kind][n], b[ms][kind][n]), (what, ms, kind, n)
        for k in COUNTERS:
            assert a[ms][k] == b[ms][k], (what, ms, k)


def reference_states(pool, plan: Plan, steps: int, w: WorkloadSpec = W, cfg: RLConfig = CFG) -> dict:
    """The training model-stages' state after ``steps`` steps on ``plan`` without a transition."""
    ref = RLDriver(SPEC, w, plan, TASK, 4, cfg).start(pool)
    try:
        for _ in range(steps):
            ref.step()
        return states(ref)
    finally:
        ref.close()
