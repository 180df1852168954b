"""A pool of Ray worker actors, one per device, and the store they rendezvous through (DESIGN.md §4.7).

The driver (the controller's process) hosts the ``TCPStore``; workers connect to it as clients and
build groups among any subset of themselves on demand. The store listens on the loopback address for
a local run and on the driver's node address for a multi-node one, never on every interface
(:func:`host_store`; docs/runtime.md, "What listens where"). Growing or shrinking the pool needs no
world-wide init: new workers only join the groups built after they arrive.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nereus.runtime.worker.failures import WorkerFailure

__all__ = ["WorkerPool", "host_store"]


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


def host_store(host: str):
    """The job's ``TCPStore`` master, listening on ``host`` only: ``(store, listening socket)``.

    ``TCPStore(host, 0, is_master=True)`` alone listens on every interface (``host`` only tells
    clients where to connect), with no authentication, so anyone who can reach the node could read
    and overwrite the rendezvous keys. Here the socket is bound to ``host`` first (the loopback
    ``127.0.0.1`` for a local run; the driver's node address for a multi-node run) and handed to the
    store (``master_listen_fd``). Keep the socket object alive as long as the store.

    Raises:
        OSError: ``host`` cannot be bound.
    """
    import socket

    family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(1024)
    store = dist.TCPStore(host, sock.getsockname()[1], is_master=True, wait_for_workers=False,
                          master_listen_fd=sock.fileno())
    return store, sock


def _kill_local(pid: int | None) -> None:
    """SIGKILL a worker process on this machine at once. ``ray.kill`` first asks the actor to exit,
    which a stopped (SIGSTOP) or deadlocked process never does, so its sockets would stay open and
    its peers would wait for their group timeout. Only a process that is still a Ray worker of ours
    (its command line names the worker class) is signalled."""
    import os
    import signal

    if not pid:
        return
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"Worker" not in f.read():
                return
        os.kill(pid, signal.SIGKILL)
    except (OSError, ProcessLookupError):
        pass  # gone already, or not on this machine


class WorkerPool:
    """Ray worker actors (one per device) and the ``TCPStore`` they rendezvous through.

    The driver hosts the store; workers connect as clients, so :meth:`add` can grow a running job
    and :meth:`remove` shrink it without any world-wide init.

    Workers are :class:`~nereus.runtime.worker.fault_tolerant.FaultTolerantWorker` actors: :meth:`get` waits for
    remote calls while pinging every worker, so a worker that dies or hangs is detected, killed and
    reported (:class:`~nereus.runtime.worker.failures.WorkerLost`) instead of blocking the job.

    Args:
        num_workers: actors to start.
        timeout_s: the timeout of every group the workers build.
        hang_timeout_s: seconds a worker may leave a heartbeat unanswered before it is declared hung.
        address: the Ray cluster to attach to (``ray.init(address=...)``); None starts a local one.

    Raises:
        ValueError: a non-positive count or timeout.
    """

    def __init__(self, num_workers: int, timeout_s: float = 60.0, hang_timeout_s: float = 10.0,
                 address: str | None = None) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be a positive integer, got {num_workers!r}")
        if not hang_timeout_s > 0 or not timeout_s > 0:
            raise ValueError(f"timeout_s and hang_timeout_s must be > 0 seconds, got {timeout_s}, {hang_timeout_s}")
        self.num_workers, self.timeout_s = num_workers, float(timeout_s)
        self.hang_timeout_s, self.address = float(hang_timeout_s), address
        self.workers: list = []
        self.pids: list[int] = []
        self.nodes: list[str] = []       # Ray node ids when the cluster has several nodes
        self.node_of: list[int] = []     # node index of each worker
        self.per_node = num_workers
        self.host = "127.0.0.1"
        self.progress_bound_s: float | None = None  # seconds without progress before a busy worker is slow
        self.phase_bounds_s: dict[str, float] = {}  # longer bounds of some phases (run/faults.py, Progress)
        self.start_timeout_s: float | None = None  # seconds workers may take to start (None: 4x timeout + 60)
        self.lost_ids: list[int] = []  # every worker removed as lost (remove(force=True)), in order

    def start(self) -> WorkerPool:
        """Attach to (``address``) or start Ray, host the store and start the workers.

        On a cluster of several nodes the workers are spread evenly, node by node, so worker ``i``
        sits on node ``i // workers_per_node`` (the planner's GPU numbering; ``node_of``), and the
        store listens on the driver's reachable address instead of the loopback.

        Raises:
            ValueError: ``num_workers`` does not split evenly over the nodes with a CPU (or GPU).
        """
        import ray

        if not ray.is_initialized():
            if self.address:
                ray.init(address=self.address, include_dashboard=False, log_to_driver=False)
            else:
                # a new local instance even when another Ray cluster runs on this machine
                ray.init(address="local", num_cpus=self.num_workers, include_dashboard=False, log_to_driver=False)
        dev = "GPU" if torch.cuda.is_available() else "CPU"
        nodes = sorted((n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get(dev, 0) >= 1),
                       key=lambda n: n["NodeID"])
        self.nodes = [n["NodeID"] for n in nodes] if len(nodes) > 1 else []
        if self.nodes and self.num_workers % len(self.nodes):
            raise ValueError(f"{self.num_workers} workers do not split evenly over the cluster's "
                             f"{len(self.nodes)} nodes; use a multiple of {len(self.nodes)}")
        self.host = ray.util.get_node_ip_address() if self.nodes or self.address else "127.0.0.1"
        self.store, self._listen = host_store(self.host)  # listens on self.host only
        self.per_node = self.num_workers // len(self.nodes) if self.nodes else self.num_workers
        self.add(self.num_workers)
        return self

    @property
    def num_nodes(self) -> int:
        return max(1, len(self.nodes))

    def add(self, k: int) -> list[int]:
        """Start ``k`` more workers; returns their ids. On several nodes, worker ``i`` is pinned to node
        ``i // per_node`` (Ray node affinity); workers past the last node go where Ray puts them."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from nereus.runtime.worker.fault_tolerant import fault_tolerant_class

        cls = fault_tolerant_class(num_gpus=1 if torch.cuda.is_available() else 0)
        env = {"env_vars": {"OMP_NUM_THREADS": "1"}}
        first = len(self.workers)
        new = []
        for i in range(first, first + k):
            opts: dict = {"runtime_env": env}
            node = i // self.per_node if self.nodes else 0
            if self.nodes and node < len(self.nodes):
                opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(self.nodes[node], soft=False)
            self.node_of.append(node)
            new.append(cls.options(**opts).remote(i, self.host, self.store.port, self.timeout_s))
        _ray_get([w.ping.remote() for w in new], "starting workers", self.start_timeout_s or 4 * self.timeout_s + 60)
        self.pids.extend(_ray_get([w.pid.remote() for w in new], "worker pids", 60))
        self.workers.extend(new)
        return list(range(first, first + k))

    def get(self, futures, what: str, timeout_s: float):
        """Results of ``futures``, watching every worker (``faults.monitored_get``).

        Raises:
            WorkerLost: a worker died or hung (it is killed and its slot set to None).
            WorkerFailure: a call failed or ``timeout_s`` passed.
        """
        from nereus.runtime.run.faults import monitored_get

        return monitored_get(self, futures, what, timeout_s, self.hang_timeout_s)

    def remove(self, i: int, force: bool = False, notify: bool = True) -> None:
        """Stop worker ``i`` (its slot stays, as None, so ids remain stable). ``force`` also SIGKILLs
        its process when it runs on this machine (a hung or stopped worker that would not exit);
        ``notify`` tells the others to drop their communicators with it (not when all are going)."""
        import ray

        if self.workers[i] is not None:
            ray.kill(self.workers[i])
            self.workers[i] = None
            if force:  # lost (dead, hung or slow): recorded for the recovery that follows (run/recovery.py)
                self.lost_ids.append(i)
                _kill_local(self.pids[i] if i < len(self.pids) else None)
            # every remaining worker drops the communicators it shared with ``i`` (comm/cache.py);
            # queued behind each actor's earlier calls, not waited on here
            for w in self.workers if notify else ():
                if w is not None:
                    w.forget_worker.remote(i)

    def close(self) -> None:
        """Stop every worker. No ``forget_worker`` calls: a worker killed while running one was
        reported by Ray as "A worker died … by an unexpected system error" after every run."""
        for i in range(len(self.workers)):
            self.remove(i, notify=False)
