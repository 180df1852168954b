"""Specs: parameter counts, KV bytes, FLOPs against published sizes and reference formulas."""

import json

import pytest

from nereus.spec.hardware import ClusterSpec, get_gpu
from nereus.spec.job import JobSpec
from nereus.spec.model import ModelSpec
from nereus.spec.presets import get_model
from nereus.spec.workload import WorkloadSpec
from nereus.workflow import ModelStage, workflow_for


def test_llama_8b_parameter_count_matches_published():
    assert get_model("llama-3.1-8b").num_params == 8_030_261_248


@pytest.mark.parametrize("name,published", [("llama-3.3-70b", 70.6e9), ("qwen3-14b", 14.8e9),
                                            ("qwen3-32b", 32.8e9)])
def test_other_presets_match_published_sizes(name, published):
    # Model cards round to 0.1 B parameters.
    assert abs(get_model(name).num_params - published) < 0.06e9


def test_layer_parameter_count_by_hand():
    m = get_model("llama-3.1-8b")
    h, f = 4096, 14336
    assert m.params_per_layer == 2 * h * h + 2 * h * 1024 + 3 * h * f + 2 * h == 218_112_000


def test_kv_bytes_per_token():
    m = get_model("llama-3.1-8b")
    assert m.kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2 == 131_072
    assert m.kv_bytes_per_token(tp=2) == 65_536
    assert m.kv_bytes_per_token(tp=16) == 2 * 32 * 1 * 128 * 2  # KV heads replicated past 8


@pytest.mark.parametrize("s,expected_gf", [(2048, 48.25), (4096, 51.47)])
def test_training_flops_per_token_megatron_and_reference(s, expected_gf):
    m = get_model("llama-3.1-8b")
    L, h, a, g, d, F, V = 32, 4096, 32, 8, 128, 14336, 128256
    megatron = 12 * L * h * h * ((1 + g / a + s / h) * (a * d / h) + (F / h) * 1.5 + V / (2 * L * h))
    ours = 3 * m.fwd_flops_per_token(context=s, causal=False)
    assert ours == pytest.approx(megatron, rel=1e-12)
    assert ours / 1e9 == pytest.approx(expected_gf, abs=0.01)  # cost-model.md §2.1 figures
    # PaLM: 6N + 12·L·H·Q·T with N without the input embedding
    n = m.num_params - V * h
    assert ours == pytest.approx(6 * n + 12 * L * a * d * s, rel=1e-3)


def test_explicit_head_dim_wins(tmp_path):
    cfg = {"hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
           "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
           "model_type": "qwen3"}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    m = ModelSpec.from_json_file(p)
    assert m.head_dim == 128 and m.q_dim == 8192
    assert m.num_params == get_model("qwen3-32b").num_params


@pytest.mark.parametrize("content,needle", [("{not json", "not valid JSON"),
                                            ('{"hidden_size": 8}', "missing required field"),
                                            ('[1, 2]', "JSON object")])
def test_malformed_config_json(tmp_path, content, needle):
    p = tmp_path / "config.json"
    p.write_text(content)
    with pytest.raises(ValueError, match=needle):
        ModelSpec.from_json_file(p)


def test_bad_inputs_name_the_field():
    with pytest.raises(ValueError, match="unknown model"):
        get_model("gpt-9")
    with pytest.raises(ValueError, match="unknown GPU"):
        get_gpu("tpu")
    with pytest.raises(ValueError, match="num_nodes"):
        ClusterSpec(get_gpu("h100"), 0, 8)
    with pytest.raises(ValueError, match="response_len"):
        WorkloadSpec(response_len=-1)
    with pytest.raises(ValueError, match="mini_batch_size"):
        WorkloadSpec(prompts_per_step=10, samples_per_prompt=1, mini_batch_size=4)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ModelSpec("x", 64, 128, 2, num_attention_heads=4, num_kv_heads=3, head_dim=16, vocab_size=10)
    with pytest.raises(ValueError, match="algorithm"):
        WorkloadSpec(algorithm="dpo")


def test_gpu_presets_carry_sources_and_units():
    h100 = get_gpu("h100")
    assert h100.peak_flops == pytest.approx(989.4e12)
    assert h100.memory_bytes == 81559 * 2**20
    assert h100.scaleout_bandwidth == 50e9  # 400 Gb/s NDR, not 400 GB/s
    for name in ("h100", "h200", "a100", "mi250x"):
        assert "datasheet" in get_gpu(name).source or "per GCD" in get_gpu(name).source


def test_workflows():
    ppo = workflow_for(WorkloadSpec(algorithm="ppo"))
    assert [m.name for m in ppo.in_stage("infer")] == ["actor.infer", "critic.infer", "reference.infer",
                                                       "reward.infer"]
    assert [m.name for m in ppo.in_stage("train")] == ["actor.train", "critic.train"]
    grpo = workflow_for(WorkloadSpec(algorithm="grpo", reward_model=False))
    assert "critic.train" not in [m.name for m in grpo.model_stages]
    assert "reward.infer" not in [m.name for m in grpo.model_stages]
    assert ppo.weight_sync == ((ModelStage("actor", "train"), ModelStage("actor", "generate")),)
    remax = WorkloadSpec(algorithm="remax", prompts_per_step=8, samples_per_prompt=2, mini_batch_size=16)
    assert remax.rollouts_per_step == 8 * 2 + 8  # one greedy baseline rollout per prompt


def test_job_yaml_roundtrip(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text("model: llama-3.1-8b\ncluster: {gpu: h100, num_nodes: 2, gpus_per_node: 8}\n"
                 "workload: {algorithm: grpo, response_len: 4096}\n")
    job = JobSpec.from_file(p)
    assert job.workload.response_len == 4096 and job.cluster.num_gpus == 16
    assert job.model("critic").head == "value"
