"""A pool of Ray worker actors, one per device, and the store they rendezvous through (DESIGN.md §4.7).

The driver (the controller's process) hosts the ``TCPStore``; workers connect to it as clients and
build groups among any subset of themselves on demand. Growing or shrinking the pool needs no
world-wide init: new workers only join the groups built after they arrive.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nereus.runtime.worker import ray_worker_class

__all__ = ["WorkerFailure", "WorkerPool"]


class WorkerFailure(RuntimeError):
    """A worker died, a collective timed out, or a remote call failed."""


def _ray_get(futures, what: str, timeout: float):
    import ray

    try:
        return ray.get(futures, timeout=timeout)
    except ray.exceptions.GetTimeoutError as e:
        raise WorkerFailure(f"{what}: no answer within {timeout:.0f}s") from e
    except ray.exceptions.RayActorError as e:
        raise WorkerFailure(f"{what}: a worker died: {str(e)[:300]}") from e
    except ray.exceptions.RayTaskError as e:
        raise WorkerFailure(f"{what}: {str(e)[-600:]}") from e


class WorkerPool:
    """Ray worker actors (one per device) and the ``TCPStore`` they rendezvous through.

    The driver hosts the store; workers connect as clients, so :meth:`add` can grow a running job
    and :meth:`remove` shrink it without any world-wide init.

    Args:
        num_workers: actors to start.
        timeout_s: the timeout of every group the workers build.
    """

    def __init__(self, num_workers: int, timeout_s: float = 60.0) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be a positive integer, got {num_workers!r}")
        self.num_workers, self.timeout_s = num_workers, float(timeout_s)
        self.workers: list = []

    def start(self) -> WorkerPool:
        import ray

        if not ray.is_initialized():
            ray.init(num_cpus=self.num_workers, include_dashboard=False, log_to_driver=False)
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.add(self.num_workers)
        return self

    def add(self, k: int) -> list[int]:
        """Start ``k`` more workers; returns their ids."""
        cls = ray_worker_class(num_gpus=1 if torch.cuda.is_available() else 0)
        env = {"env_vars": {"OMP_NUM_THREADS": "1"}}
        first = len(self.workers)
        new = [cls.options(runtime_env=env).remote(first + i, "127.0.0.1", self.store.port, self.timeout_s)
               for i in range(k)]
        _ray_get([w.ping.remote() for w in new], "starting workers", 4 * self.timeout_s + 60)
        self.workers.extend(new)
        return list(range(first, first + k))

    def remove(self, i: int) -> None:
        """Stop worker ``i`` (its slot stays, as None, so ids remain stable)."""
        import ray

        if self.workers[i] is not None:
            ray.kill(self.workers[i])
            self.workers[i] = None

    def close(self) -> None:
        for i in range(len(self.workers)):
            self.remove(i)
