"""Worker pools of the fault benchmark (``benchmarks/bench_faults.py``), started ahead of need.

Measured on 2 shared CPU cores (``--faults 10 --seed 5151 --verbose``, load 3-8): of a run's wall time,
about a quarter went to starting worker processes (each imports torch): 3-12 s per join before a
step, the scheduled joins and the spot replacement of every lost worker, about ten per run; and
each replay started a pool of its own, one worker per worker id the faulty run ever used (10-14).

* :class:`SparePool` keeps ``spares`` worker actors started ahead for the next worker ids, so a join
  takes one that has already imported everything (a ping) instead of starting a process. The run
  sees exactly what a :class:`~nereus.runtime.run.pool.WorkerPool` gives it: the same ids, stores,
  timeouts and actor class; a spare is not in ``workers`` (no heartbeat, no call, no fault) until it
  joins, and :meth:`SparePool.close` stops the spares too.
* Every worker of a :class:`SparePool` (``warm=True``) imports ``torch.distributed.checkpoint`` as it
  starts (queued before its first call), as every writer does at its first checkpoint anyway. That
  first save took 4-8 s where the others took 0.1-2.5 s, and the progress bound of a checkpoint
  write is ``max(--timeout, 4 x the longest checkpoint so far)``: a worker slow inside a later save
  was caught only after 20-33 s, not after the 15 s floor. The rule and the faults are unchanged.
* :func:`replay_pool` keeps one pool for every replay of a benchmark (a fault-free
  :class:`~nereus.runtime.run.driver.RLDriver` that closes its engines after each replay; group names
  carry each driver's own tag, so nothing of one replay is seen by the next), grown when a replay
  needs more workers; :func:`close_replay_pool` stops it at the end.
"""

from __future__ import annotations

from nereus.runtime.run.pool import WorkerPool, _ray_get

__all__ = ["SparePool", "replay_pool", "close_replay_pool"]


class SparePool(WorkerPool):
    """A :class:`WorkerPool` (local, one node) with ``spares`` actors started ahead for the next ids."""

    def __init__(self, *args, spares: int = 2, warm: bool = True, **kw) -> None:
        super().__init__(*args, **kw)
        if spares < 0:
            raise ValueError(f"spares must be >= 0, got {spares}")
        self.spares, self.warm = int(spares), bool(warm)
        self._ahead: list[tuple[int, object]] = []  # (worker id, actor handle), ids ascending from len(workers)

    def _actor(self, i: int):
        from nereus.runtime.worker.fault_tolerant import fault_tolerant_class

        cls = fault_tolerant_class(num_gpus=0)
        w = cls.options(runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}}).remote(
            i, self.host, self.store.port, self.timeout_s)
        if self.warm:  # queued before any other call (module docstring)
            w.__ray_call__.remote(_import_dcp)
        return w

    def add(self, k: int) -> list[int]:
        """Start ``k`` more workers (taking the spares started ahead first); returns their ids.

        Raises:
            ValueError: the pool spans several nodes (spares are for a local pool).
            WorkerFailure: a worker did not start within the start timeout.
        """
        if self.nodes:
            raise ValueError("SparePool is for a local pool (one node)")
        first = len(self.workers)
        new = []
        for i in range(first, first + k):
            if self._ahead and self._ahead[0][0] == i:
                new.append(self._ahead.pop(0)[1])
            else:
                new.append(self._actor(i))
            self.node_of.append(0)
        _ray_get([w.ping.remote() for w in new], "starting workers", self.start_timeout_s or 4 * self.timeout_s + 60)
        self.pids.extend(_ray_get([w.pid.remote() for w in new], "worker pids", 60))
        self.workers.extend(new)
        nxt = first + k
        self._ahead = [(i, w) for i, w in self._ahead if i >= nxt]
        have = {i for i, _ in self._ahead}
        for i in range(nxt, nxt + self.spares):  # started now, ready by the next join
            if i not in have:
                self._ahead.append((i, self._actor(i)))
        self._ahead.sort(key=lambda x: x[0])
        return list(range(first, first + k))

    def close(self) -> None:
        import ray

        super().close()
        for _, w in self._ahead:
            ray.kill(w)
        self._ahead = []


def _import_dcp(_worker) -> None:
    """Run in a worker (``__ray_call__``): import what its first checkpoint save imports."""
    import torch.distributed.checkpoint  # noqa: F401


def _by_value() -> None:
    """Workers cannot import this folder's modules: :func:`_import_dcp` is sent by value."""
    import sys

    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])


_by_value()

_REPLAY: dict = {}


def replay_pool(n: int, start) -> WorkerPool:
    """The benchmark's replay pool with at least ``n`` workers: started with ``start(n)`` the first
    time (``bench_faults.start_pool``), grown with :meth:`WorkerPool.add` when a replay needs more,
    and started again if a worker of it was lost (a replay has no faults; this is a guard)."""
    import ray

    job = ray.get_runtime_context().get_job_id()
    if _REPLAY.get("job") != job:  # another Ray session (e.g. the next test module's): its actors are gone
        _REPLAY.clear()
    pool = _REPLAY.get("pool")
    if pool is not None and any(w is None for w in pool.workers):
        close_replay_pool()
        pool = None
    if pool is None:
        pool = _REPLAY["pool"] = start(n)
        _REPLAY["job"] = job
    elif len(pool.workers) < n:
        pool.add(n - len(pool.workers))
    return pool


def close_replay_pool() -> None:
    """Stop the replay pool, if one was started."""
    pool = _REPLAY.pop("pool", None)
    if pool is not None:
        pool.close()
