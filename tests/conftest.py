"""Shared fixtures: a local Ray instance and a pool of CPU workers, one per test module.

``ray_cluster`` starts Ray with 8 CPUs unless it is already running (then it is left as it is);
``pool`` adds a :class:`nereus.runtime.run.pool.WorkerPool` of 4 workers with a 30 s call timeout. A
module that needs another CPU count overrides ``ray_cpus`` (a module-scoped fixture), e.g. one spare
CPU for a worker that joins later.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def ray_cpus() -> int:
    return 8


@pytest.fixture(scope="module")
def ray_cluster(ray_cpus):
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=ray_cpus, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def pool(ray_cluster):
    from nereus.runtime.run.pool import WorkerPool

    p = WorkerPool(4, timeout_s=30).start()
    yield p
    p.close()
