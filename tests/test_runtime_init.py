"""Per-shard random initialization (layout.init_shard_params): every layout's shards are the slices of
the same logical tensors, and a shard draws only the tiles it overlaps."""

from __future__ import annotations

import math

import pytest
import torch

from nereus.runtime.model.sharding import (
    INIT_TILE,
    init_full_params,
    init_param,
    init_shard_params,
    names_of_stage,
    param_shapes,
    shard,
)
from nereus.spec.model import ModelSpec
from nereus.spec.presets import MODEL_PRESETS

# vocab 137 is not a multiple of tp=2 or 4 (padded rows); 2 KV heads are replicated at tp=4
PADDED = ModelSpec(name="padded", hidden_size=80, intermediate_size=136, num_layers=3, num_attention_heads=4,
                   num_kv_heads=2, head_dim=20, vocab_size=137, qkv_bias=True, o_bias=True)
TIED = ModelSpec(name="tied", hidden_size=72, intermediate_size=96, num_layers=4, num_attention_heads=4,
                 num_kv_heads=4, head_dim=18, vocab_size=130, tie_word_embeddings=True, qk_norm=True)
VALUE = ModelSpec(name="value", hidden_size=72, intermediate_size=96, num_layers=3, num_attention_heads=4,
                  num_kv_heads=1, head_dim=18, vocab_size=70, head="value")


@pytest.mark.parametrize("spec", [PADDED, TIED, VALUE], ids=lambda s: s.name)
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (4, 2), (2, 3)])
def test_shards_equal_slices_of_full(spec, tp, pp):
    full = init_full_params(spec, 7)
    shapes = param_shapes(spec)
    for p in range(pp):
        names = names_of_stage(spec, pp, p)
        for t in range(tp):
            got = init_shard_params(spec, 7, pp, p, tp, t)
            assert list(got) == names
            for n in names:
                want = shard(full[n], shapes[n][1], spec, tp, t)
                assert got[n].dtype == torch.float32 and torch.equal(got[n], want), (n, tp, pp, p, t)


def test_values_and_distribution():
    spec = PADDED
    full = init_full_params(spec, 3)
    assert set(full) == set(param_shapes(spec))
    for n, (shape, _rule) in param_shapes(spec).items():
        assert tuple(full[n].shape) == tuple(shape)
        if n.endswith("norm.weight"):
            assert torch.equal(full[n], torch.ones(shape))
    w = torch.cat([full[n].flatten() for n in full if not n.endswith("norm.weight")])
    assert abs(float(w.mean())) < 1e-3 and abs(float(w.std()) - 0.02) < 1e-3
    # distinct seeds and distinct tensors give different values; the same seed repeats exactly
    again = init_full_params(spec, 3)
    assert all(torch.equal(full[n], again[n]) for n in full)
    other = init_full_params(spec, 4)
    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"
    assert not torch.equal(full[q], other[q]) and not torch.equal(full[q], full[k])
    # no two tiles of a model repeat (tile seeds are distinct): compare first rows of all tiles
    tr, tc = INIT_TILE
    heads = {tuple(full[n][i:i + 1, j:j + tc].flatten()[:4].tolist())
             for n in full if full[n].dim() == 2 and full[n].shape[1] >= 4
             for i in range(0, full[n].shape[0], tr) for j in range(0, full[n].shape[1] - 3, tc)}
    n_tiles = sum(-(-full[n].shape[0] // tr) * len(range(0, full[n].shape[1] - 3, tc))
                  for n in full if full[n].dim() == 2 and full[n].shape[1] >= 4)
    assert len(heads) == n_tiles


def test_value_head_variant_shares_backbone():
    lm = ModelSpec(name="m", hidden_size=72, intermediate_size=96, num_layers=3, num_attention_heads=4,
                   num_kv_heads=1, head_dim=18, vocab_size=70)
    a, v = init_full_params(lm, 5), init_full_params(VALUE, 5)
    for n in v:
        if not n.startswith("score."):
            assert torch.equal(a[n], v[n]), n
    assert torch.equal(v["score.bias"], torch.zeros(1))


def test_bf16_shard_is_the_cast_of_fp32():
    got = init_shard_params(TIED, 1, 2, 1, 2, 1, dtype=torch.bfloat16)
    ref = init_shard_params(TIED, 1, 2, 1, 2, 1)
    assert all(got[n].dtype == torch.bfloat16 and torch.equal(got[n], ref[n].to(torch.bfloat16)) for n in got)


def test_init_param_ranges():
    n = "model.layers.0.mlp.down_proj.weight"
    full = init_full_params(PADDED, 2)[n]
    assert torch.equal(init_param(PADDED, 2, n, rows=(5, 70), cols=(63, 130)), full[5:70, 63:130])
    b = "model.layers.2.self_attn.q_proj.bias"
    assert torch.equal(init_param(PADDED, 2, b, rows=(10, 75)), init_full_params(PADDED, 2)[b][10:75])
    e = "model.embed_tokens.weight"
    padded = init_param(PADDED, 2, e, rows=(130, 137), pad_rows=3)
    assert torch.equal(padded, torch.cat([init_full_params(PADDED, 2)[e][130:], torch.zeros(3, 80)]))
    assert torch.equal(init_param(PADDED, 2, "model.norm.weight", pad_rows=2), torch.cat([torch.ones(80), torch.zeros(2)]))
    with pytest.raises(ValueError, match="pad_rows"):
        init_param(PADDED, 2, e, pad_rows=-1)
    with pytest.raises(ValueError, match="outside"):
        init_param(PADDED, 2, n, rows=(0, 81))
    with pytest.raises(ValueError, match="1-D"):
        init_param(PADDED, 2, b, cols=(0, 1))
    with pytest.raises(KeyError):
        init_param(PADDED, 2, "lm_head.bias")


def _tiles_overlapping(lo: int, hi: int, size: int, step: int) -> int:
    """Elements along one dim of the tiles overlapping ``[lo, hi)`` (edge tiles clipped at ``size``)."""
    return sum(min(step, size - s) for s in range(lo // step * step, hi, step))


def test_tp4_shard_draws_only_its_tiles():
    spec = MODEL_PRESETS["small"]  # hidden 256, MLP 512, 8x32 query / 4x32 KV heads, vocab 64
    shapes = param_shapes(spec)
    full_elems = sum(math.prod(s) for s, _ in shapes.values())
    tr, tc = INIT_TILE
    for t in range(4):
        stats = {}
        got = init_shard_params(spec, 0, 1, 0, 4, t, stats=stats)
        # expected count, from the shard's row/column ranges (independent of the implementation's loop)
        want = 0
        for n, (shape, rule) in shapes.items():
            if n.endswith("norm.weight"):
                continue
            r, c = (shape[0], 1) if len(shape) == 1 else shape
            rows, cols = (0, r), (0, c)
            if rule in ("col", "kv"):
                k = r // 4 if rule == "col" else spec.head_dim
                rows = (t * k, (t + 1) * k) if rule == "col" else ((t // 2) * k, (t // 2 + 1) * k)
            elif rule == "row":
                cols = (t * c // 4, (t + 1) * c // 4)
            elif rule == "vocab":
                rows = (t * r // 4, (t + 1) * r // 4)
            want += _tiles_overlapping(*rows, r, tr) * _tiles_overlapping(*cols, c, tc)
        assert stats["generated"] == want
        held = sum(x.numel() for x in got.values())
        # the TP=4 shard draws far less than the full model: its own quarter plus the partly used
        # tiles of the replicated KV heads (32 of a 64-row tile) and of the 64-row vocab
        assert held <= stats["generated"] < 0.35 * full_elems, (stats, held, full_elems)
    stats = {}
    init_shard_params(spec, 0, 1, 0, 1, 0, stats=stats)
    norms = sum(math.prod(s) for n, (s, _) in shapes.items() if n.endswith("norm.weight"))
    assert stats["generated"] == full_elems - norms
