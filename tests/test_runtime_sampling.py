"""Vocab-parallel sampling (rollout.py): counter-based Gumbel noise any vocab range of which can be drawn
alone, and the TP argmax over (value, id) pairs that equals the full-vocabulary argmax."""

from __future__ import annotations

import math

import pytest
import torch

from nereus.runtime.worker.rollout import gumbel_noise, vocab_parallel_argmax


class _FakeGroup:
    """The TP group of rank ``rank`` whose members' tensors are precomputed (all_gather returns them)."""

    def __init__(self, parts: list[torch.Tensor], rank: int) -> None:
        self.parts, self.rank, self.size = parts, rank, len(parts)

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        assert t.shape == self.parts[self.rank].shape and torch.equal(t, self.parts[self.rank])
        return [p.clone() for p in self.parts]


def _pairs(scores: torch.Tensor, tp: int, vocab: int) -> list[torch.Tensor]:
    """Each rank's ``[b, 2]`` (max value, id) over its padded vocab shard, computed independently."""
    c = -(-vocab // tp)
    out = []
    for t in range(tp):
        best_v, best_i = [], []
        for row in scores:
            ids = [i for i in range(t * c, min((t + 1) * c, vocab))]
            if not ids:
                best_v.append(float("-inf"))
                best_i.append(float(t * c))
                continue
            m = max(float(row[i]) for i in ids)
            best_v.append(m)
            best_i.append(float(next(i for i in ids if float(row[i]) == m)))
        out.append(torch.tensor([best_v, best_i], dtype=torch.float64).T.contiguous())
    return out


@pytest.mark.parametrize("tp,vocab", [(1, 13), (2, 13), (3, 13), (4, 13), (4, 16), (8, 5)])
def test_vocab_parallel_argmax_equals_full_argmax_lowest_id_on_ties(tp, vocab):
    g = torch.Generator().manual_seed(tp * 100 + vocab)
    scores = torch.randint(0, 4, (40, vocab), generator=g).float()  # many ties
    scores[0] = 7.0  # all tied: id 0
    want = scores.argmax(-1)
    assert int(want[0]) == 0
    c = -(-vocab // tp)
    parts = _pairs(scores, tp, vocab)
    for t in range(tp):
        local = torch.full((40, c), 123.0)  # padding columns hold garbage and must never win
        hi = min((t + 1) * c, vocab)
        if hi > t * c:
            local[:, :hi - t * c] = scores[:, t * c:hi]
        got = vocab_parallel_argmax(local, t * c, vocab, _FakeGroup(parts, t) if tp > 1 else None)
        assert got.dtype == torch.int64 and torch.equal(got, want), (tp, vocab, t)


def test_noise_of_a_range_is_the_slice_of_the_full_row():
    seeds = [0, 1, 12345, 2**40 + 3, -7]
    for step in (0, 1, 17):
        full = gumbel_noise(seeds, step, 0, 101)
        assert full.shape == (5, 101) and full.dtype == torch.float32
        for lo, hi in [(0, 26), (26, 52), (52, 101), (37, 38), (100, 101), (50, 50)]:
            assert torch.equal(gumbel_noise(seeds, step, lo, hi), full[:, lo:hi])
        # a row depends on its own seed only, not on the batch it is drawn in
        assert torch.equal(gumbel_noise([12345], step, 0, 101)[0], full[2])
    with pytest.raises(ValueError, match="range"):
        gumbel_noise([0], 0, 5, 4)


def test_noise_is_standard_gumbel_and_gumbel_max_samples_the_softmax():
    n = 20000
    noise = torch.cat([gumbel_noise(list(range(s * 1000, s * 1000 + 1000)), s, 0, 50) for s in range(n // 1000)])
    # standard Gumbel: mean = Euler-Mascheroni constant, variance = pi^2/6
    assert abs(float(noise.mean()) - 0.5772157) < 0.01
    assert abs(float(noise.var()) - math.pi ** 2 / 6) < 0.03
    # neighbouring ids, steps and seeds are uncorrelated
    a = gumbel_noise(list(range(n)), 3, 0, 2)
    b = gumbel_noise(list(range(n)), 4, 0, 1)
    c = gumbel_noise(list(range(1, n + 1)), 3, 0, 1)
    for x, y in [(a[:, 0], a[:, 1]), (a[:, 0], b[:, 0]), (a[:-1, 0], c[:-1, 0])]:
        r = float(torch.corrcoef(torch.stack([x, y]))[0, 1])
        assert abs(r) < 4 / math.sqrt(n), r
    # Gumbel-max with temperature: frequencies of argmax(logits/T + g) match softmax(logits/T)
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5])
    temp = 0.7
    draws = torch.cat([gumbel_noise(list(range(1000)), s, 0, 5) for s in range(n // 1000)])
    picks = (logits / temp + draws).argmax(-1)
    freq = torch.bincount(picks, minlength=5).double() / n
    p = torch.softmax(logits.double() / temp, -1)
    sigma = torch.sqrt(p * (1 - p) / n)
    assert bool(((freq - p).abs() < 4.5 * sigma).all()), (freq, p)
