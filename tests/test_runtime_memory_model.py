"""The runtime's accounted training peak equals the cost model's runtime terms byte for byte, and the
meter counts each saved storage once, parameters and their views never.

Workers run in this process (``WorkerCore`` on an in-process ``TCPStore``, one-worker layouts), no Ray.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

os.environ.setdefault("OMP_NUM_THREADS", "1")

from nereus.cost.memory import stage_memory  # noqa: E402
from nereus.runtime.comm.instrument import Meter  # noqa: E402
from nereus.runtime.comm.parallel import Layout  # noqa: E402
from nereus.runtime.model.precision import workload_bytes  # noqa: E402
from nereus.runtime.worker.core import WorkerCore  # noqa: E402
from nereus.runtime.worker.engine import AdamConfig  # noqa: E402
from nereus.spec.presets import MODEL_PRESETS  # noqa: E402
from nereus.spec.workload import WorkloadSpec  # noqa: E402

T, P = 9, 5
R = T - P


def test_meter_counts_each_saved_storage_once_and_no_parameter_view():
    m = Meter()
    w = torch.randn(6, 4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    with m.track_activations({id(w)}, [w]):
        h = x * 2.0  # saves nothing (a constant factor)
        y = h @ w.t()  # saves h and w.t() (a view of w: not an activation)
        z = (h * h).sum() + y.exp().sum()  # h twice more (counted once), exp's output 3x6
    assert m.device_bytes == 3 * 4 * 4 + 3 * 6 * 4
    z.backward()
    del z, y, h
    assert m.device_bytes == 0


@pytest.fixture(scope="module")
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


@pytest.mark.parametrize("kind,n,b", [("actor", 8, 2), ("critic", 8, 2), ("actor", 4, 4)])
def test_train_peak_equals_the_runtime_terms(store, kind, n, b):
    """One update of ``n`` sequences in micro-batches of ``b`` on the tiny model: the worker's peak
    tracked bytes are the weights and moments plus the cost model's transient (the gradient buffer,
    the saved activations of one micro-batch and the loss's), exactly."""
    spec = MODEL_PRESETS["tiny"]
    core = WorkerCore({"actor": 40, "critic": 41}[kind] + 2 * b, "127.0.0.1", store.port, timeout_s=10)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(3, spec.vocab_size, (n, T), generator=g)
    if kind == "actor":
        ms, s = "actor.train", spec
        batch = {"tokens": tokens, "mask": torch.ones(n, R), "old_logp": -torch.rand(n, R, generator=g),
                 "adv": torch.randn(n, R, generator=g)}
        loss = {"kind": "actor", "prompt_len": P, "clip": 0.2, "kl_coef": 0.0, "temperature": 1.0}
    else:
        ms, s = "critic.train", spec.value_head()
        batch = {"tokens": tokens, "mask": torch.ones(n, R), "old_values": torch.zeros(n, R),
                 "returns": torch.randn(n, R, generator=g)}
        loss = {"kind": "critic", "prompt_len": P, "clip": 0.5}
    core.build(ms, s, Layout(1, 1, 1, (core.id,)), 0, True, AdamConfig(), tag=f"mm{kind}{b}")
    core.reset_measurements()
    core.train(ms, batch, loss, b, float(n * R), 1)
    w = WorkloadSpec(prompt_len=P, response_len=R, micro_batch_size=b, mini_batch_size=n, prompts_per_step=n,
                     samples_per_prompt=1, **workload_bytes("fp32"), activation_model="runtime")
    m = stage_memory("train", s, w, 1, 1, micro_batch=b)
    assert core.engines[ms].state_bytes == m["resident"]
    assert core.measurements()["peak_bytes"] == m["resident"] + m["transient"]
    assert core.meter.device_bytes == m["resident"]  # gradients and activations freed after the update
