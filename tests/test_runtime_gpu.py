"""The GPU path's device and backend selection, checked on CPU (``comm.backend_for``,
``comm.new_group``, ``worker.select_device``); the CUDA parts run only where CUDA exists
(``benchmarks/gpu_check.py`` runs the parity check and a live transition on real devices)."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from nereus.runtime.comm import groups as comm
from nereus.runtime.comm.groups import CommError, Group, backend_for, new_group
from nereus.runtime.comm.instrument import Meter
from nereus.runtime.worker.device import select_device


def test_backend_follows_the_device(monkeypatch):
    assert backend_for(None) == backend_for("cpu") == backend_for(torch.device("cpu")) == "gloo"
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert backend_for("cuda:0") == backend_for(torch.device("cuda", 1)) == "nccl"
    assert backend_for("cpu") == "gloo"
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    assert backend_for("cuda:0") == "gloo"  # a CUDA build without NCCL stages through host memory


class _FakeNCCL:
    """Stands in for ``ProcessGroupNCCL`` on a CPU build: records how it was built."""

    built: list = []

    class Options:
        _timeout = None

    def __init__(self, store, rank, size, opts):
        self.store, self.rank, self.size, self.opts = store, rank, size, opts
        _FakeNCCL.built.append(self)


def test_new_group_builds_nccl_for_cuda_devices_with_the_timeout(monkeypatch):
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(dist, "ProcessGroupNCCL", _FakeNCCL, raising=False)
    monkeypatch.setattr(dist, "ProcessGroupGloo", lambda *a: pytest.fail("gloo built for a CUDA device"))
    _FakeNCCL.built.clear()
    store = dist.HashStore()
    g = new_group(store, "t/nccl", (3, 5, 7), 5, Meter(), timeout_s=12.0, device="cuda:1")
    assert (g.backend, g.device, g.rank, g.size, g.direct) == ("nccl", "cuda:1", 1, 3, True)
    pg = _FakeNCCL.built[-1]
    assert (pg.rank, pg.size) == (1, 3) and pg.opts._timeout == datetime.timedelta(seconds=12)
    assert isinstance(pg.store, dist.PrefixStore)
    # a group of one needs no process group, on any backend
    one = new_group(store, "t/one", (5,), 5, Meter(), device="cuda:0")
    assert one.pg is None and one.backend == "nccl"


def test_new_group_keeps_gloo_on_cpu(monkeypatch):
    seen = []
    monkeypatch.setattr(dist, "ProcessGroupGloo", lambda store, rank, size, timeout: seen.append(
        (rank, size, timeout)) or "pg")
    g = new_group(dist.HashStore(), "t/gloo", (0, 1), 1, Meter(), timeout_s=7.0)
    assert (g.backend, g.device, g.direct, g.pg) == ("gloo", "cpu", False, "pg")
    assert seen == [(1, 2, datetime.timedelta(seconds=7))]


def test_nccl_group_refuses_host_tensors_and_orders_pair_exchanges():
    calls = []

    class PG:
        def send(self, bufs, dst, tag):
            calls.append(("send", dst))
            return _Done()

        def recv(self, bufs, src, tag):
            calls.append(("recv", src))
            return _Done()

    g = Group("t", (0, 1), 0, PG(), Meter(), backend="nccl", device="cuda:0")
    with pytest.raises(CommError, match="CUDA"):
        g.all_reduce(torch.zeros(4))
    with pytest.raises(CommError, match="CUDA"):
        g.recv(torch.zeros(4), 1)
    # the pair's lower rank sends first, the higher receives first (one stream per NCCL pair)
    g._host = lambda t: t  # no CUDA here: skip the device check for the ordering
    g.sendrecv(torch.zeros(2), torch.zeros(2), 1)
    hi = Group("t", (0, 1), 1, PG(), Meter(), backend="nccl", device="cuda:0")
    hi._host = lambda t: t
    hi.sendrecv(torch.zeros(2), torch.zeros(2), 0)
    assert calls[-4:] == [("send", 1), ("recv", 1), ("recv", 0), ("send", 0)]
    assert "p2p@nccl" in g.meter.measurements()["op_seconds"]


class _Done:
    def wait(self):
        return True


def test_one_cuda_device_per_worker():
    assert select_device(3, cuda_count=0, ray_gpu_ids=None, visible=None) == "cpu"
    # Ray sets CUDA_VISIBLE_DEVICES to the actor's GPU: it is device 0 of the process
    assert select_device(3, cuda_count=1, ray_gpu_ids=[5], visible="5") == "cuda:0"
    # all GPUs visible (Ray told not to set it): the assigned id's position
    assert select_device(3, cuda_count=8, ray_gpu_ids=[5], visible="0,1,2,3,4,5,6,7") == "cuda:5"
    assert select_device(3, cuda_count=8, ray_gpu_ids=["2"], visible=None) == "cuda:2"
    # local processes (no Ray): worker i takes device i modulo the count
    assert select_device(5, cuda_count=4, ray_gpu_ids=None, visible=None) == "cuda:1"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_worker_uses_its_device():
    from nereus.runtime.worker.core import WorkerCore

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    core = WorkerCore(0, "127.0.0.1", store.port)
    assert core.device.startswith("cuda:") and torch.cuda.current_device() == torch.device(core.device).index
    assert comm.backend_for(core.device) == ("nccl" if dist.is_nccl_available() else "gloo")
