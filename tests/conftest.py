"""Shared fixtures: one local Ray instance for the whole test run, and a pool of CPU workers per module.

``ray_cluster`` starts Ray once (``RAY_CPUS`` logical CPUs, no dashboard) on first use and keeps it
for every later module (DESIGN.md §6: Ray tests share one local cluster per test run); it is shut
down when the run ends. A module that needs a cluster of its own (a multi-node ``ray.cluster_utils``
cluster) is marked ``own_cluster``: it shuts the shared instance down and builds its own, and the next
module that asks for ``ray_cluster`` gets a fresh shared instance. If Ray is already running when the
run starts (started by the caller), it is used as it is and left running.

``pool`` adds a :class:`nereus.runtime.run.pool.WorkerPool` of 4 workers with a 30 s call timeout,
one per module (modules kill workers, so pools are not shared across them).
"""

from __future__ import annotations

import pytest

#: logical CPUs of the shared instance: the most any module schedules at once (the fault benchmark's
#: runs: 6 workers, their replay and a joining worker); Ray only counts them, the cores are shared
RAY_CPUS = 16

_state = {"ours": False}


def pytest_configure(config):
    config.addinivalue_line("markers", "own_cluster: builds its own Ray cluster (shuts the shared one down)")


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        # a new local cluster, never the latest one on the machine (another run's, or one a test leaked)
        ray.init(address="local", num_cpus=RAY_CPUS, include_dashboard=False, log_to_driver=False)
        _state["ours"] = True
    yield ray


@pytest.fixture(scope="session", autouse=True)
def _shutdown_shared_ray():
    yield
    if _state["ours"]:
        import ray

        if ray.is_initialized():
            ray.shutdown()


@pytest.fixture(scope="module")
def pool(ray_cluster):
    from nereus.runtime.run.pool import WorkerPool

    p = WorkerPool(4, timeout_s=30).start()
    yield p
    p.close()
