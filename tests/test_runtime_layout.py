"""Property tests of the runtime's pure parts: TP/PP sharding rules and RL advantage invariants."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nereus.cost.shapes import valid_tp
from nereus.runtime.model.sharding import (
    init_full_params,
    names_of_stage,
    param_shapes,
    shard,
    unshard,
    validate_layout,
)
from nereus.runtime.rl import algorithms as alg
from nereus.spec.model import ModelSpec
from nereus.spec.presets import MODEL_PRESETS


@st.composite
def spec_and_tp(draw):
    g = draw(st.sampled_from([1, 2, 4]))
    a = g * draw(st.sampled_from([1, 2, 4]))
    spec = ModelSpec(name="p", hidden_size=16, intermediate_size=8 * draw(st.integers(1, 3)),
                     num_layers=draw(st.integers(1, 5)), num_attention_heads=a, num_kv_heads=g, head_dim=4,
                     vocab_size=draw(st.integers(17, 40)), qk_norm=draw(st.booleans()),
                     tie_word_embeddings=draw(st.booleans()), head=draw(st.sampled_from(["lm", "value"])),
                     qkv_bias=draw(st.booleans()), o_bias=draw(st.booleans()))
    tps = [t for t in (1, 2, 4, 8) if valid_tp(spec, t) is None]
    return spec, draw(st.sampled_from(tps))


@settings(max_examples=40, deadline=None)
@given(spec_and_tp(), st.integers(1, 5))
def test_shard_unshard_roundtrip_and_pp_partition(st_tp, pp):
    spec, tp = st_tp
    full = init_full_params(spec, 0)
    for n, (_shape, rule) in param_shapes(spec).items():
        parts = [shard(full[n], rule, spec, tp, t) for t in range(tp)]
        assert len({p.shape for p in parts}) == 1, (n, rule)  # equal shapes: gloo all-gather needs them
        assert torch.equal(unshard(parts, rule, spec), full[n]), (n, rule, tp)
    pp = min(pp, spec.num_layers)
    names = [n for p in range(pp) for n in names_of_stage(spec, pp, p)
             if not (p > 0 and n == "model.embed_tokens.weight")]
    # every parameter on exactly one PP rank, except the tied embedding's output-layer copy (last rank)
    assert sorted(names) == sorted(param_shapes(spec))
    copy = pp > 1 and spec.tie_word_embeddings and spec.head == "lm"
    assert ("model.embed_tokens.weight" in names_of_stage(spec, pp, pp - 1)) == (copy or pp == 1)


def test_validate_layout_errors():
    tiny = MODEL_PRESETS["tiny"]
    validate_layout(tiny, 4, 4)  # 2 KV heads replicated at tp=4
    with pytest.raises(ValueError, match="tp=3"):
        validate_layout(tiny, 3, 1)
    with pytest.raises(ValueError, match="pp=5"):
        validate_layout(tiny, 1, 5)
    with pytest.raises(ValueError, match="'tp' must be a positive integer"):
        validate_layout(tiny, 0, 1)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6), st.integers(2, 5), st.integers(1, 6), st.integers(0, 10_000))
def test_advantage_invariants(groups, size, R, seed):
    g = torch.Generator().manual_seed(seed)
    B = groups * size
    scores = torch.rand(B, generator=g)
    lengths = torch.randint(1, R + 1, (B,), generator=g)
    mask = (torch.arange(R)[None, :] < lengths[:, None]).float()
    a = alg.grpo_advantages(scores, size, mask)
    per_seq = a[torch.arange(B), 0].view(groups, size)
    assert torch.allclose(per_seq.sum(1), torch.zeros(groups), atol=1e-4)  # zero mean per group
    assert torch.equal(a * (1 - mask), torch.zeros_like(a))
    values = torch.randn(B, R, generator=g)
    rewards = torch.randn(B, R, generator=g) * mask
    adv, ret = alg.gae(rewards, values, mask, gamma=1.0, lam=1.0)
    # gamma = lam = 1: the advantage is the reward-to-go minus the value
    rtg = torch.flip(torch.cumsum(torch.flip(rewards, [1]), 1), [1])
    assert torch.allclose(adv, (rtg - values) * mask, atol=1e-5)
    assert torch.allclose(ret, rtg * mask, atol=1e-5)
    w = alg.masked_whiten(torch.randn(B, R, generator=g), mask)
    if mask.sum() > 1:
        assert abs(float((w * mask).sum() / mask.sum())) < 1e-4


def test_grpo_groups_of_one_take_mean_zero_and_std_one_as_verl():
    """verl's ``compute_grpo_outcome_advantage`` gives a prompt with one response mean 0 and std 1:
    the advantage is the score over ``1 + eps``; ``WorkloadSpec`` takes GRPO at ``n = 1``."""
    from nereus.spec.workload import WorkloadSpec

    scores, mask = torch.tensor([2.0, -0.5, 0.0]), torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    a = alg.grpo_advantages(scores, 1, mask, eps=0.25)
    assert torch.equal(a, torch.tensor([[1.6, 1.6], [-0.4, 0.0], [0.0, 0.0]]))
    with pytest.raises(ValueError, match="group_size=0"):
        alg.grpo_advantages(scores, 0, mask)
    assert WorkloadSpec(algorithm="grpo", samples_per_prompt=1, prompts_per_step=8, mini_batch_size=8).global_batch == 8
