"""A group rendezvous the driver can release when a member is lost (DESIGN.md §4.7, §4.9; issue 30).

Building a gloo communicator (``ProcessGroupGloo(store, rank, size, timeout)``) blocks in the store
until every member has published its address, for up to the group's timeout (``--timeout``, 15-60 s).
Killing a lost worker closes its sockets, which ends its peers' *collectives* at once, but not a
*rendezvous*: a peer waiting for the lost member's key in the ``TCPStore`` keeps waiting for the full
timeout, so recovery started only after it (issue 30: "Peers of a SIGSTOPped worker sit in group
rendezvous until the communicator timeout while the log says 'died; detected in 1.00s'").

:func:`arrive` is a presence barrier run just before the process group is built: each member sets
``arrived/<rank>`` under the group's prefix and polls, without blocking in the store, whether every
member's key exists (``Store.check``, one round trip, so the worker's shared store client is never
held by a blocked call), sleeping 1 ms doubling to 20 ms between polls. Between polls it looks at
``abort``, a ``threading.Event`` the driver sets through the worker's ``cancel`` call (answered in
the worker's ``control`` thread) as soon as it detects a loss (``run/faults.py``); the wait then
raises :class:`~nereus.runtime.comm.groups.CommError` naming the abort, and the recovery starts.
Only after every member arrived is the process group built, so its own store waits are short.

A member that dies after it arrived but before it published its gloo address (a window of one store
round trip) would still leave its peers blocked in the process group's own store wait, which
nothing releases, for the group timeout. :func:`build_released` closes that window: the group is
built in a helper thread over a store client of its own (a second ``TCPStore`` connection to the
same server, so a blocked wait holds no socket or lock the worker's other calls need), while the
calling thread polls ``abort`` as :func:`arrive` does; once it is set the call raises
:class:`RendezvousAborted` and abandons the helper. The helper's store is a :class:`_Releasable`
wrapper of that client whose blocking reads (``get``, ``wait``) poll ``check`` and give up as soon as
the build is abandoned, so the abandoned helper ends within a poll interval; before, it stayed
blocked in the store (a thread and a half-built gloo context) until the group timeout, 15-60 s after
the recovery had started. The second connection is shared by the worker's successive builds (and
the groups built on it) and replaced after an abandoned build, so a worker holds two connections to
the store, not one per group.

Not covered: NCCL builds its communicator lazily at the first collective, whose release is the NCCL
watchdog's (``TORCH_NCCL_ASYNC_ERROR_HANDLING``), not this module's.
"""

from __future__ import annotations

import datetime
import threading
import time

__all__ = ["arrive", "build_released", "RendezvousAborted", "RendezvousTimeout", "RELEASED"]

#: the words of a released wait's error, which the driver counts in a failed call's error (``run/faults.py``)
RELEASED = "released by the driver"

#: first and longest sleep between two polls of the barrier, seconds
POLL_MIN_S, POLL_MAX_S = 0.001, 0.02


class RendezvousAborted(RuntimeError):
    """The driver released the wait (a member was lost)."""


class RendezvousTimeout(RuntimeError):
    """Some member did not arrive within the group's timeout."""


def arrive(store, rank: int, size: int, timeout_s: float, abort: threading.Event | None = None) -> float:
    """Wait until all ``size`` members have called :func:`arrive` on ``store`` (a store under the
    group's own prefix), or ``abort`` is set, or ``timeout_s`` passes.

    Args:
        store: a ``torch.distributed.Store`` whose keys are the group's (a ``PrefixStore``).
        rank: this member's group rank, ``0 <= rank < size``.
        timeout_s: seconds to wait for the others (the group's timeout), > 0.
        abort: set by another thread to release the wait.

    Returns:
        seconds waited.

    Raises:
        ValueError: ``rank`` outside ``[0, size)`` or a non-positive ``timeout_s``.
        RendezvousAborted: ``abort`` was set before every member arrived.
        RendezvousTimeout: not every member arrived within ``timeout_s`` (names the missing ranks).
    """
    if not 0 <= rank < size:
        raise ValueError(f"rendezvous: rank must be in [0, {size}), got {rank}")
    if not timeout_s > 0:
        raise ValueError(f"rendezvous: timeout_s must be > 0 seconds, got {timeout_s}")
    t0 = time.perf_counter()
    store.set(f"arrived/{rank}", b"1")
    keys = [f"arrived/{r}" for r in range(size)]
    delay = POLL_MIN_S
    while not store.check(keys):
        if abort is not None and abort.is_set():
            raise RendezvousAborted(f"{RELEASED} after {time.perf_counter() - t0:.2f}s: a member was lost")
        if time.perf_counter() - t0 > timeout_s:
            missing = [r for r in range(size) if not store.check([f"arrived/{r}"])]
            raise RendezvousTimeout(f"ranks {missing} did not arrive within {timeout_s:.0f}s")
        time.sleep(delay)
        delay = min(2 * delay, POLL_MAX_S)
    return time.perf_counter() - t0


def _releasable_class():
    """:class:`_Releasable`, defined on first use (``torch.distributed`` is imported lazily here)."""
    global _Releasable
    if _Releasable is not None:
        return _Releasable
    import torch.distributed as dist

    class Releasable(dist.Store):
        """A ``Store`` over ``inner`` whose blocking reads poll ``inner.check`` (1 ms doubling to 20 ms)
        and raise ``RuntimeError`` once ``released()`` is true or ``timeout_s`` has passed, so a gloo
        build blocked in it (waiting for a lost member's address) ends when it is abandoned."""

        def __init__(self, inner, released, timeout_s: float) -> None:
            super().__init__()
            self.inner, self.released, self.timeout_s = inner, released, float(timeout_s)

        def _until(self, keys) -> None:
            t0, delay = time.perf_counter(), POLL_MIN_S
            while not self.inner.check(list(keys)):
                if self.released():
                    raise RuntimeError(f"group build abandoned ({RELEASED}) while waiting for {list(keys)}")
                if time.perf_counter() - t0 > self.timeout_s:
                    raise RuntimeError(f"keys {list(keys)} not set within {self.timeout_s:.0f}s")
                time.sleep(delay)
                delay = min(2 * delay, POLL_MAX_S)

        def get(self, key):
            self._until([key])
            return self.inner.get(key)

        def wait(self, keys, timeout=None):
            self._until(keys)

        def set(self, key, value):
            return self.inner.set(key, value)

        def add(self, key, value):
            return self.inner.add(key, value)

        def check(self, keys):
            return self.inner.check(keys)

        def compare_set(self, key, expected, desired):
            return self.inner.compare_set(key, expected, desired)

        def delete_key(self, key):
            return self.inner.delete_key(key)

        def num_keys(self):
            return self.inner.num_keys()

        def set_timeout(self, timeout):
            return self.inner.set_timeout(timeout)

    _Releasable = Releasable
    return Releasable


_Releasable = None

#: the helper threads' store clients, by (host, port, timeout): one per worker process and store
_SPARE: dict = {}
_SPARE_LOCK = threading.Lock()


def build_released(build, store, timeout_s: float, abort: threading.Event):
    """``build(client)`` in a helper thread, released by ``abort`` (module docstring).

    Args:
        build: builds the group from a store, e.g. ``lambda s:
            ProcessGroupGloo(PrefixStore(name, s), rank, size, timeout)``; it gets a
            :class:`_Releasable` over the client, so its store waits run in the helper thread and end
            once the build is abandoned.
        store: the worker's store client; a ``TCPStore`` is not shared with the helper, which uses
            a client of its own to the same host and port (timeout ``timeout_s``; shared by this
            process's builds until one is abandoned); any other store (an in-process ``HashStore``)
            is passed as is.
        timeout_s: the group's timeout, seconds (the helper client's wait timeout), > 0.
        abort: set by another thread to release the wait.

    Returns:
        what ``build`` returns.

    Raises:
        ValueError: a non-positive ``timeout_s``.
        RendezvousAborted: ``abort`` was set before the build finished.
        whatever ``build`` raised (e.g. gloo's ``RuntimeError`` at the group timeout).
    """
    import torch.distributed as dist

    if not timeout_s > 0:
        raise ValueError(f"rendezvous: timeout_s must be > 0 seconds, got {timeout_s}")
    box: dict = {}
    key = (store.host, store.port, float(timeout_s)) if isinstance(store, dist.TCPStore) else None

    def run() -> None:
        try:
            client = store
            if key is not None:
                with _SPARE_LOCK:
                    if box.get("abandoned"):
                        return
                    client = _SPARE.get(key)
                    if client is None:
                        client = _SPARE[key] = dist.TCPStore(store.host, store.port, is_master=False,
                                                             timeout=datetime.timedelta(seconds=timeout_s))
                    box["client"] = client
            box["out"] = build(_releasable_class()(client, lambda: bool(box.get("abandoned")), timeout_s))
        except BaseException as e:  # noqa: BLE001  (re-raised in the calling thread)
            box["error"] = e

    t0 = time.perf_counter()
    helper = threading.Thread(target=run, name="group-build", daemon=True)
    helper.start()
    delay = POLL_MIN_S
    while helper.is_alive():
        helper.join(delay)
        delay = min(2 * delay, POLL_MAX_S)
        if helper.is_alive() and abort.is_set():
            with _SPARE_LOCK:  # the abandoned helper gives up at its next poll; the next build opens another client
                box["abandoned"] = True
                if key is not None and _SPARE.get(key) is box.get("client"):
                    _SPARE.pop(key, None)
            raise RendezvousAborted(f"{RELEASED} after {time.perf_counter() - t0:.2f}s: a member was lost while "
                                    "the group was being built")
    if "error" in box:
        raise box["error"]
    return box["out"]
