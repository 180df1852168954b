"""An engine rebuilt from moved state (``Engine(state=...)``, a live transition's last step) takes the
given Adam moments as they are and allocates no zero moments beside them (issue 26: two fp32 zero
tensors per parameter, 8 B/param of transient memory the planner did not count). One process, a
layout of one worker (no process group)."""

from __future__ import annotations

import torch

from nereus.runtime.comm.instrument import Meter
from nereus.runtime.comm.parallel import Layout, build_context
from nereus.runtime.model.sharding import init_full_params
from nereus.runtime.worker.engine import Engine
from nereus.spec.presets import MODEL_PRESETS

TINY = MODEL_PRESETS["tiny"]


def _engine(state=None) -> Engine:
    meter = Meter()
    ctx = build_context(TINY, Layout(1, 1, 1, (0,)), 0, None, "t", meter)
    return Engine(TINY, ctx, 0, meter, True, None, torch.float32, "cpu", state=state)


def test_given_moments_are_taken_without_zero_moments(monkeypatch):
    full = init_full_params(TINY, 0)
    m = {n: torch.full_like(w, 0.5) for n, w in full.items()}
    v = {n: torch.full_like(w, 0.25) for n, w in full.items()}
    calls = []
    real = torch.zeros_like

    def counting(t, *a, **k):
        calls.append(tuple(t.shape))
        return real(t, *a, **k)

    monkeypatch.setattr(torch, "zeros_like", counting)
    e = _engine({"tensors": {"params": full, "exp_avg": m, "exp_avg_sq": v}, "counters": {"step": 3}})
    assert calls == []
    assert all(e.exp_avg[n] is m[n] and e.exp_avg_sq[n] is v[n] for n in full) and e.step == 3
    fresh = _engine()  # no state: zero moments, one per parameter and moment
    assert len(calls) == 2 * len(full)
    assert all(torch.equal(fresh.exp_avg[n], torch.zeros_like(full[n])) for n in full)
