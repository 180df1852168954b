"""Packing and assembly of live-transition transfers, run in one process (``transit/packing.py``,
``transit/index.py``): every worker's send buffers are built, handed to their receivers as the wire
would, and the assembled shards are compared bit for bit with ``sharding.shard`` of the full
tensors (the reference). Pure: no Ray, no process group."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from nereus.runtime.model.precision import WEIGHT_KINDS, train_kinds
from nereus.runtime.model.sharding import init_full_params, names_of_stage, param_shapes, shard
from nereus.runtime.transit.index import stage_names, stage_regions
from nereus.runtime.transit.packing import COUNTERS, HEADER_BYTES, assemble, pack, recv_sizes
from nereus.runtime.transit.plans import MoveSpec, UnitMeta, cache_clear, kind_dtype, plan_moves
from nereus.runtime.transit.worker_side import Unit
from nereus.spec.presets import MODEL_PRESETS

TINY = MODEL_PRESETS["tiny"]
KINDS = train_kinds("fp32")
_FULL: dict = {}


def _value(spec, name: str, kind: str) -> torch.Tensor:
    """A distinct full tensor per (parameter, state kind)."""
    if spec not in _FULL:
        _FULL[spec] = init_full_params(spec, 7)
    full = _FULL[spec][name]
    return full * (1 + KINDS.index(kind)) if kind in KINDS else full


def _shard_unit(spec, meta: UnitMeta, worker: int, kinds, dtype) -> Unit:
    p, t = meta.position(worker)
    tensors = {k: {n: shard(_value(spec, n, k), param_shapes(spec)[n][1], spec, meta.tp, t).to(kind_dtype(k, dtype))
                   for n in names_of_stage(spec, meta.pp, p)} for k in kinds}
    return Unit(meta, tensors, {c: 10 * i + worker for i, c in enumerate(COUNTERS)})


def _run(spec, move: MoveSpec, dtype=torch.float32):
    """Every worker's pack, the wire as a dict, every worker's assembly: (made per worker, bytes
    received per worker, the units read)."""
    workers = sorted({w for u in move.sources + move.local + move.produces for w in u.gpus})
    held = {w: {u.uid: _shard_unit(spec, u, w, move.kinds, dtype) for u in move.sources + move.local
                if w in u.gpus} for w in workers}
    sent = {w: pack(spec, plan_moves(spec, move, w), w, held[w].__getitem__, dtype, "cpu") for w in workers}
    made, got = {}, {}
    for w in workers:
        plan = plan_moves(spec, move, w)
        sizes = recv_sizes(spec, plan, w, dtype)
        recv = {}
        for s, n in sizes.items():
            buf, payload = sent[s][w]
            assert payload == n and buf.numel() == HEADER_BYTES + n
            recv[s] = (buf[HEADER_BYTES:], dict(zip(COUNTERS, buf[:HEADER_BYTES].view(torch.int64).tolist())))
        got[w] = sum(sizes.values())
        made[w] = assemble(spec, plan, move, w, recv, held[w].__getitem__, dtype, "cpu")
    return made, got, held


def _check_exact(spec, move, made, dtype=torch.float32):
    for dst in move.produces:
        for w in dst.gpus:
            tensors, counters = made[w][dst.uid]
            p, t = dst.position(w)
            assert set(counters) == set(COUNTERS)
            for k in move.kinds:
                assert sorted(tensors[k]) == sorted(names_of_stage(spec, dst.pp, p))
                for n, x in tensors[k].items():
                    ref = shard(_value(spec, n, k), param_shapes(spec)[n][1], spec, dst.tp, t).to(kind_dtype(k, dtype))
                    assert x.dtype == ref.dtype and torch.equal(x, ref), (dst.uid, w, k, n)


def test_stage_index_matches_the_sharding_rules():
    tied = replace(TINY, tie_word_embeddings=True)
    for spec in (TINY, tied, MODEL_PRESETS["small"]):
        for pp in (1, 2, 3, 4):
            for p in range(pp):
                assert list(stage_names(spec, pp, p)) == names_of_stage(spec, pp, p)
    # the tied embedding's output copy on the last PP rank, the KV head of tp 4 > 2 heads
    assert "model.embed_tokens.weight" in stage_names(tied, 2, 1)
    assert stage_regions(TINY, 4, 1, 0, 3)["model.layers.0.self_attn.k_proj.weight"].lo == 16
    with pytest.raises(ValueError, match="PP rank p=2 outside 0..1"):
        stage_names(TINY, 2, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_extend_and_merge_assemble_the_target_shards_bit_for_bit(dtype):
    cache_clear()
    odd = replace(TINY, vocab_size=63)  # vocab padding under tp 2: one zero row no segment writes
    src = UnitMeta("s", "actor.train", 2, 2, (0, 1, 2, 3))
    halves = (UnitMeta("s/0", "actor.train", 1, 2, (0, 2)), UnitMeta("s/1", "actor.train", 1, 2, (1, 3)))
    split = MoveSpec("split", "split", "actor.train", consumes=("s",), produces=halves, sources=(src,),
                     local=(src,), kinds=KINDS)
    dst = UnitMeta("e", "actor.train", 2, 2, (7, 6, 5, 4))
    extend = MoveSpec("extend", "extend", "actor.train", produces=(dst,), sources=(src,), kinds=WEIGHT_KINDS)
    one = UnitMeta("u", "actor.train", 1, 2, (0, 1))
    tp2 = UnitMeta("t", "actor.train", 2, 1, (0, 1))
    merge = MoveSpec("merge", "merge", "actor.train", consumes=("u",), produces=(tp2,), sources=(one,),
                     local=(one,), kinds=KINDS)
    for spec in (TINY, odd):
        for move in (split, extend, merge):
            made, _got, _held = _run(spec, move, dtype)
            _check_exact(spec, move, made, dtype)


def test_padding_rows_are_zero_and_bytes_are_the_plans():
    odd = replace(TINY, vocab_size=63)
    src = UnitMeta("s", "actor.train", 1, 1, (0,))
    dst = UnitMeta("e", "actor.train", 2, 1, (1, 2))
    move = MoveSpec("extend", "extend", "actor.train", produces=(dst,), sources=(src,), kinds=WEIGHT_KINDS)
    made, got, _held = _run(odd, move)
    emb = made[2]["e"][0]["params"]["model.embed_tokens.weight"]
    assert emb.shape == (32, 64) and torch.equal(emb[31], torch.zeros(64))
    # worker 2 gets rows 32..62 of the two vocab tensors and half of every split tensor, all of the norms
    h, F, L = 64, 128, 4
    split = L * (2 * h * h + 2 * 32 * h + 3 * h * F) // 2
    assert got[2] == 4 * (split + 2 * 31 * h + L * 2 * h + h)


def test_a_whole_consumed_local_tensor_is_taken_without_a_copy():
    units = tuple(UnitMeta(f"u{i}", "actor.train", 1, 1, (g,)) for i, g in enumerate((0, 1)))
    tgt = UnitMeta("t", "actor.train", 1, 2, (0, 1))
    move = MoveSpec("merge", "merge", "actor.train", consumes=("u0", "u1"), produces=(tgt,), sources=units,
                    local=units, kinds=KINDS)
    made, got, held = _run(TINY, move)
    assert got == {0: 0, 1: 0}
    for w, u in ((0, "u0"), (1, "u1")):
        for k in KINDS:
            for n, x in made[w]["t"][0][k].items():
                assert x is held[w][u].tensors[k][n]
    _check_exact(TINY, move, made)
