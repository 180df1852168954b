"""A worker's device capacity and the host pool: offload/restore round trips bit for bit, the accounted
device bytes never exceed the capacity, and a train step after a round trip equals one without.

Workers run in this process (``WorkerCore`` on an in-process ``TCPStore``, layouts of one worker: no
collectives), so the module needs no Ray.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

os.environ.setdefault("OMP_NUM_THREADS", "1")

from nereus.runtime.comm.instrument import DeviceMemoryError, Meter  # noqa: E402
from nereus.runtime.comm.parallel import Layout  # noqa: E402
from nereus.runtime.worker.core import WorkerCore  # noqa: E402
from nereus.runtime.worker.engine import AdamConfig  # noqa: E402
from nereus.runtime.worker.memory_pool import MemoryPools  # noqa: E402
from nereus.spec.presets import MODEL_PRESETS  # noqa: E402

SPEC = MODEL_PRESETS["tiny"]
N, T, P, MB = 4, 9, 5, 2
LOSS = {"kind": "actor", "prompt_len": P, "clip": 0.2, "kl_coef": 0.0, "temperature": 1.0}


@pytest.fixture(scope="module")
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _core(store, wid: int) -> WorkerCore:
    return WorkerCore(wid, "127.0.0.1", store.port, timeout_s=10)


def _batch():
    g = torch.Generator().manual_seed(3)
    R = T - P
    return {"tokens": torch.randint(3, SPEC.vocab_size, (N, T), generator=g), "mask": torch.ones(N, R),
            "old_logp": -torch.rand(N, R, generator=g), "adv": torch.randn(N, R, generator=g)}


def _snapshot(engine) -> dict:
    return {k: {n: t.detach().clone() for n, t in d.items()} for k, d in engine.state_tensors().items()}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_offload_restore_round_trip_bit_exact(store, precision):
    core = _core(store, 10 if precision == "fp32" else 11)
    lay = Layout(1, 1, 1, (core.id,))
    core.build("actor.train", SPEC, lay, 0, True, AdamConfig(lr=1e-2), tag=f"rt{precision}", precision=precision,
               offload="host")
    e = core.engines["actor.train"]
    core.train("actor.train", _batch(), LOSS, MB, float(N * (T - P)), 1)  # moments are non-zero now
    before = _snapshot(e)
    params = dict(e.model.params)  # the parameter objects themselves
    nbytes = e.state_bytes
    numel = sum(w.numel() for w in e.model.params.values())
    assert nbytes == numel * ((4 + 8) if precision == "fp32" else (2 + 4 + 8))  # engine.py's table
    dev0 = core.meter.device_bytes
    moved = core.pools.offload("actor.train", e)
    assert moved == nbytes
    assert core.meter.device_bytes == dev0 - nbytes
    assert all(w.numel() == 0 for w in e.model.params.values())
    assert all(t.numel() == 0 for d in e.state_tensors().values() for t in d.values())
    st = core.pools.stats()
    assert st["offload_bytes"] == nbytes and st["host_bytes"] == nbytes and st["offload_s"] > 0
    # the host copies are new buffers with the exact values
    for k, d in core.pools.host["actor.train"].items():
        for n, h in d.items():
            assert torch.equal(h, before[k][n]), (k, n)
    core._engine("actor.train")  # its turn: restored
    assert core.pools.stats()["restore_bytes"] == nbytes and core.pools.stats()["host_bytes"] == 0
    assert core.meter.device_bytes == dev0
    for k, d in e.state_tensors().items():
        for n, t in d.items():
            assert torch.equal(t, before[k][n]) and t.dtype == before[k][n].dtype, (k, n)
    assert all(e.model.params[n] is w for n, w in params.items())
    # a step after the round trip equals a step on an engine that never moved
    ref = _core(store, 20 if precision == "fp32" else 21)
    ref.build("actor.train", SPEC, Layout(1, 1, 1, (ref.id,)), 0, True, AdamConfig(lr=1e-2), tag=f"ref{precision}",
              precision=precision)
    ref.train("actor.train", _batch(), LOSS, MB, float(N * (T - P)), 1)
    b2 = _batch()
    b2["adv"] = -b2["adv"]
    core.train("actor.train", b2, LOSS, MB, float(N * (T - P)), 2)
    ref.train("actor.train", b2, LOSS, MB, float(N * (T - P)), 2)
    a, b = _snapshot(core.engines["actor.train"]), _snapshot(ref.engines["actor.train"])
    for k in a:
        for n in a[k]:
            assert torch.equal(a[k][n], b[k][n]), (k, n)


def test_capacity_enforced_and_offload_makes_room(store):
    core = _core(store, 12)
    lay = Layout(1, 1, 1, (core.id,))
    batch = _batch()
    vbatch = {"tokens": batch["tokens"], "mask": batch["mask"], "old_values": torch.zeros(N, T - P),
              "returns": batch["adv"]}
    closs = {"kind": "critic", "prompt_len": P, "clip": 0.5}
    denom = float(N * (T - P))
    # each trained model-stage alone: its state and its peak with the saved activations
    sizes, peaks = {}, {}
    for ms, spec, b, loss in (("actor.train", SPEC, batch, LOSS), ("critic.train", SPEC.value_head(), vbatch, closs)):
        core.build(ms, spec, lay, 0, True, AdamConfig(), tag=f"cap0{ms}")
        sizes[ms] = core.engines[ms].state_bytes
        core.reset_measurements()
        core.train(ms, b, loss, MB, denom, 1)
        peaks[ms] = core.measurements()["peak_bytes"]
        core.destroy(ms)
    assert core.meter.device_bytes == 0
    A, C = sizes["actor.train"], sizes["critic.train"]
    F = A // 3  # the frozen reference: fp32 weights only, 4 of the 12 bytes per element
    cap = max(peaks.values()) + 1024
    assert cap < A + C  # both trained states cannot be resident at once
    core.set_capacity(cap)
    core.build("actor.train", SPEC, lay, 0, True, AdamConfig(), tag="cap1")
    with pytest.raises(DeviceMemoryError, match="capacity"):
        core.build("critic.train", SPEC.value_head(), lay, 0, True, AdamConfig(), tag="cap1")
    assert "critic.train" not in core.engines
    core.destroy("actor.train")
    # three model-stages taking turns, the trained ones offloaded to the host pool while idle, the
    # frozen one dropped (its host copy written once)
    core.build("actor.train", SPEC, lay, 0, True, AdamConfig(), tag="cap2", offload="host")
    core.build("critic.train", SPEC.value_head(), lay, 0, True, AdamConfig(), tag="cap2", offload="host")
    core.build("reference.infer", SPEC, lay, 0, False, tag="cap2", dtype="float32", offload="drop")
    assert core.pools.offloaded == {"actor.train", "critic.train"}
    core.reset_measurements()
    for step in range(2):
        core.logprobs("reference.infer", batch["tokens"], P, MB)
        core.train("actor.train", batch, LOSS, MB, denom, step + 1)
        core.train("critic.train", vbatch, closs, MB, denom, step + 1)
    st = core.measurements()["memory"]
    assert core.measurements()["peak_bytes"] <= cap and st["capacity"] == cap
    # by hand: step 1 offloads the reference (first host copy, F) then the actor (A); step 2 the
    # critic (C), the reference again (unchanged: no bytes) and the actor (A)
    assert st["offload_bytes"] == F + A + C + A
    assert st["restore_bytes"] == (A + C) + (F + A + C)
    assert st["host_bytes"] == F + A  # the reference's copy stays; the actor is idle
    with pytest.raises(ValueError, match="below"):
        core.set_capacity(1)
    with pytest.raises(ValueError, match="offload"):
        core.pools.set_mode("x", "cpu_adam")


def test_meter_capacity_check_by_hand():
    m = Meter(capacity=100)
    m.set_static("a", 60)
    m.set_static("a", 90)  # replacing a key counts its new size only
    with pytest.raises(DeviceMemoryError):
        m.set_static("b", 11)
    assert m.device_bytes == 90 and m.peak_bytes == 90
    pools = MemoryPools(m)
    with pytest.raises(ValueError, match="non-negative"):
        pools.set_capacity(-1)
    pools.set_capacity(0)
    assert m.capacity is None


def test_rollback_snapshot_of_an_offloaded_engine_holds_its_state(store):
    """The fault-tolerance snapshot (``worker/fault_tolerant.py``) of a model-stage waiting in the
    host pool copies its host state, not the freed device placeholders."""
    from nereus.runtime.worker.fault_tolerant import FaultTolerantWorker

    core = FaultTolerantWorker(13, "127.0.0.1", store.port, timeout_s=10)
    lay = Layout(1, 1, 1, (core.id,))
    core.build("actor.train", SPEC, lay, 0, True, AdamConfig(lr=1e-2), tag="snap", offload="host")
    core.train("actor.train", _batch(), LOSS, MB, float(N * (T - P)), 1)
    before = _snapshot(core.engines["actor.train"])
    core.build("reference.infer", SPEC, lay, 0, False, tag="snap", dtype="float32", offload="drop")
    assert "actor.train" in core.pools.offloaded
    core.snapshot()
    snap = core.snap["actor.train"].tensors
    for k, d in before.items():
        for n, t in d.items():
            assert torch.equal(snap[k][n], t), (k, n)
