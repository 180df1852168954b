"""A job without a reference model (no KL term): the workflow has no ``reference.infer`` and its
memory is not counted, as verl (``need_reference_policy``: ``use_kl_in_reward or actor.use_kl_loss``)
and OpenRLHF (a reference only for ``--algo.kl.init_coef > 0``) build none. Memory checked by hand."""

import json

import pytest

from nereus.integrations.openrlhf import import_openrlhf, openrlhf_source
from nereus.integrations.verl import import_verl
from nereus.integrations.verl_config import load_verl_config, verl_config_dir
from nereus.planner.whatif import evaluate_layout
from nereus.spec.workload import WorkloadSpec
from nereus.workflow import workflow_for

# Qwen2.5-0.5B-Instruct's config.json fields
QWEN05 = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
          "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
          "tie_word_embeddings": True, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "model_type": "qwen2"}


def test_workflow_and_workload_field():
    w = WorkloadSpec(algorithm="grpo", reference_model=False)
    assert "reference.infer" not in {m.name for m in workflow_for(w).model_stages}
    assert "reference.infer" in {m.name for m in workflow_for(WorkloadSpec(algorithm="grpo")).model_stages}
    # left out of to_dict while True (old job files stay as they were), kept when False; round trip
    assert "reference_model" not in WorkloadSpec().to_dict()
    assert WorkloadSpec.from_dict(w.to_dict()) == w
    with pytest.raises(ValueError, match="'reference_model' must be a JSON boolean"):
        WorkloadSpec(reference_model="no")


@pytest.fixture
def qwen05(tmp_path):
    d = tmp_path / "Qwen2.5-0.5B"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(QWEN05))
    return str(d)


def _grpo(path, kl: list[str]):
    # examples/grpo_trainer style on 1 node x 8 GPUs
    return ["algorithm.adv_estimator=grpo", "data.train_batch_size=256", "data.max_prompt_length=512",
            "data.max_response_length=1024", f"actor_rollout_ref.model.path={path}",
            "actor_rollout_ref.actor.ppo_mini_batch_size=64", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.5",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16", "trainer.n_gpus_per_node=8",
            "trainer.nnodes=1", *kl]


@pytest.mark.skipif(verl_config_dir() is None, reason="verl not installed")
def test_verl_builds_a_reference_only_for_a_kl_term(qwen05):
    # Megatron engines at TP = PP = 1 (verl's defaults): the reference's bf16 weights stay on every GPU
    cfg = "ppo_megatron_trainer"
    none = import_verl(load_verl_config(cfg, _grpo(qwen05, [])))
    loss = import_verl(load_verl_config(cfg, _grpo(qwen05, ["actor_rollout_ref.actor.use_kl_loss=True"])))
    reward = import_verl(load_verl_config(cfg, _grpo(qwen05, ["algorithm.use_kl_in_reward=True"])))
    assert [c.model_stage for c in none.layout if c.model_stage == "reference.infer"] == []
    assert none.job.workload.reference_model is False
    for imp in (loss, reward):
        assert imp.job.workload.reference_model is True
        ref = next(c for c in imp.layout if c.model_stage == "reference.infer")
        assert (ref.tp, ref.pp, ref.dp, ref.zero, ref.offload) == (1, 1, 8, 0, "none")
    # by hand: Qwen2.5-0.5B has P = L(2h^2 + 2h*g*d + 3hF + 3h + 2g*d) + V*h + h = 494,032,768 parameters
    # (QKV biases, two norms per layer, tied embeddings). The reference keeps its whole bf16 weights
    # (2 bytes each) resident on every GPU, whatever stage runs: the peak without it is lower by 2P.
    h, F, L, g, d, V = 896, 4864, 24, 2, 64, 151936
    P = L * (2 * h * h + 2 * h * g * d + 3 * h * F + 3 * h + 2 * g * d) + V * h + h
    assert P == 494_032_768
    peak = {k: max(evaluate_layout(i.job, i.layout).plan.gpu_memory.values()) for k, i in
            (("none", none), ("loss", loss))}
    assert peak["loss"] - peak["none"] == pytest.approx(2 * P, rel=1e-9)


@pytest.mark.skipif(openrlhf_source() is None, reason="OpenRLHF not installed")
def test_openrlhf_builds_a_reference_only_for_a_kl_coefficient():
    base = ("--actor.num_gpus_per_node 4 --ref.num_gpus_per_node 4 --vllm.num_engines 4 "
            "--train.colocate_all --algo.advantage.estimator group_norm --rollout.n_samples_per_prompt 4 "
            "--rollout.batch_size 64 --train.batch_size 64 --data.max_len 1536 --rollout.max_new_tokens 1024 "
            "--reward.remote_url http://rm --ds.zero_stage 3")
    off = import_openrlhf(base + " --algo.kl.init_coef 0", model="qwen2.5-0.5b")
    on = import_openrlhf(base, model="qwen2.5-0.5b")  # OpenRLHF's default init_coef 0.01
    assert "reference.infer" not in {c.model_stage for c in off.layout} and not off.job.workload.reference_model
    assert "reference.infer" in {c.model_stage for c in on.layout} and on.job.workload.reference_model
    assert any("creates no reference model" in n for n in off.notes)
