"""No orphans: vLLM engine processes and hand-off files die with the worker that started them.

A vLLM engine is a tree of processes of its own (``LLM`` spawns ``VLLM::EngineCore``, which spawns one
``VLLM::Worker`` per TP rank; vLLM 0.32 ``vllm/v1/engine/utils.py``, ``vllm/v1/executor/multiproc_executor.py``).
The TP workers watch the engine core (vLLM's death pipe), but nothing watches the process that created
the ``LLM``: measured here, SIGKILL of a runtime worker holding a TP 1 engine left ``VLLM::EngineCore`` and
``VLLM::Worker`` running and the engine's directories in place. A runtime worker is killed that way whenever
it is lost or removed (``ray.kill``, ``WorkerPool.remove``), and terminated (SIGTERM) by
``run/local.py`` at the end of a run, so a clean ``close`` cannot be relied on.

:class:`Reaper` (one per worker process) keeps a *manifest* (``<HANDOFF_ROOT>/nereus-vllm-reaper-<pid>.json``)
of what this process owns: engine process ids (with their start times, so a recycled pid is never
signalled) and paths (the engine's config directory, the replica's hand-off directory, the POSIX
shared-memory segments the engine maps, e.g. vLLM's ``/dev/shm/psm_*`` message queues). A watchdog process
(this file run as a script: no torch, no nereus import; started as a grandchild in a session of its own,
``_spawn_detached``, so a worker's exit path that kills its children does not take it along) polls
the worker's pid every ``POLL_S`` seconds; when the worker is gone (killed, crashed, exited without
``close``) it terminates the engine processes (SIGTERM, SIGKILL after ``GRACE_S``), removes the paths and the
manifest, and exits. A clean :meth:`Reaper.untrack` of everything removes the manifest, and the watchdog
exits on its own. ``atexit`` also closes engines on a normal interpreter exit (``vllm_worker.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

__all__ = ["Reaper", "engine_processes", "shm_paths", "reap", "kill_and_remove", "shm_segments", "orphan_segments", "POLL_S", "GRACE_S"]

#: seconds between the watchdog's checks of the worker's pid
POLL_S = 0.5
#: seconds a terminated engine process gets before SIGKILL
GRACE_S = 3.0


def _root() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else __import__("tempfile").gettempdir()


def engine_processes(exclude: tuple[int, ...] = ()) -> list[list]:
    """``[[pid, create_time], ...]`` of every descendant of this process (the engine's tree), less
    ``exclude`` (e.g. the watchdog)."""
    import psutil

    out = []
    for p in psutil.Process().children(recursive=True):
        if p.pid in exclude:
            continue
        try:
            out.append([p.pid, p.create_time()])
        except psutil.Error:
            continue
    return out


def shm_paths(pids: list[list]) -> list[str]:
    """The POSIX shared-memory segments (``/dev/shm/psm_*``, Python's ``multiprocessing.shared_memory``,
    which vLLM's message queues use) the processes ``pids`` map."""
    import psutil

    found = set()
    for pid, _t in pids:
        try:
            for m in psutil.Process(pid).memory_maps(grouped=True):
                if m.path.startswith("/dev/shm/psm_"):
                    found.add(m.path)
        except psutil.Error:
            continue
    return sorted(found)


def shm_segments() -> set[str]:
    """The POSIX shared-memory segments (``/dev/shm/psm_*``) that exist now."""
    import glob

    return set(glob.glob("/dev/shm/psm_*"))


def orphan_segments(before: set[str]) -> list[str]:
    """The segments created since ``before`` (:func:`shm_segments`) that no process maps any more:
    what a failed engine start left (measured here: vLLM's engine core failing in its KV-cache setup
    left its 240 MiB message-queue segment, ``psm_*``, after every process had exited)."""
    import psutil

    new = shm_segments() - set(before)
    if not new:
        return []
    mapped = set()
    for p in psutil.process_iter():
        try:
            mapped.update(m.path for m in p.memory_maps(grouped=True) if m.path in new)
        except psutil.Error:
            continue
    return sorted(new - mapped)


class Reaper:
    """The manifest and watchdog of one worker process (module docstring)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.manifest = os.path.join(_root(), f"nereus-vllm-reaper-{self.pid}.json")
        self.owned: dict[str, dict] = {}
        self.watchdog: int | None = None  # the watchdog's pid (not a child of this process: _spawn_detached)

    def track(self, key: str, pids: list[list] = (), paths: list[str] = ()) -> None:
        """Own ``pids`` (``[[pid, create_time]]``) and ``paths`` under ``key`` (replacing what ``key`` held)."""
        self.owned[key] = {"pids": [list(p) for p in pids], "paths": list(paths)}
        self._write()
        if self.watchdog is None or not _running(self.watchdog):
            self.watchdog = _spawn_detached([sys.executable, os.path.abspath(__file__), str(self.pid), self.manifest])

    def release(self, key: str) -> dict:
        """After a clean shutdown of ``key``'s engine: terminate whatever of its processes is left,
        remove its paths, stop owning it. Returns what was killed and removed (``reap``'s dict)."""
        entry = self.owned.get(key)
        out = kill_and_remove([entry]) if entry else {"killed": [], "removed": []}
        self.untrack(key)
        return out

    def untrack(self, key: str) -> None:
        """Stop owning ``key``."""
        self.owned.pop(key, None)
        if self.owned:
            self._write()
            return
        try:
            os.remove(self.manifest)
        except FileNotFoundError:
            pass

    def watchdog_pid(self) -> int | None:
        return self.watchdog

    def _write(self) -> None:
        tmp = f"{self.manifest}.tmp"
        with open(tmp, "w") as f:
            json.dump({"parent": self.pid, "owned": self.owned}, f)
        os.replace(tmp, self.manifest)


def _spawn_detached(argv: list[str]) -> int:
    """Start ``argv`` as a grandchild in a session of its own (an intermediate process starts it and
    exits), so that it is not a child of this process; returns its pid. Measured here: a Ray worker that
    exits because its driver got SIGTERM takes its direct children down with it (the watchdog included,
    which left the manifest, the engine's config directory and a ``psm_*`` segment behind); a grandchild
    reparented to init is not among them."""
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--detach", *argv], stdin=subprocess.DEVNULL,
                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True, check=True, timeout=60)
    return int(p.stdout.split()[-1])


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def kill_and_remove(entries) -> dict:
    """Terminate the processes and remove the paths of manifest ``entries`` (pids whose start time
    differs were recycled: skipped); ``{"killed": [pid, ...], "removed": [path, ...]}``."""
    import psutil

    procs = []
    for entry in entries:
        for pid, t in entry["pids"]:
            try:
                p = psutil.Process(int(pid))
                if abs(p.create_time() - float(t)) < 1e-3:
                    procs.append(p)
            except psutil.Error:
                continue
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _gone, alive = psutil.wait_procs(procs, timeout=GRACE_S)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=GRACE_S)
    removed = []
    for entry in entries:
        for path in entry["paths"]:
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            elif os.path.exists(path):
                try:
                    os.remove(path)
                except OSError:
                    continue
            else:
                continue
            removed.append(path)
    return {"killed": [p.pid for p in procs], "removed": removed}


def reap(manifest: str) -> dict:
    """Terminate the processes and remove the paths ``manifest`` lists, then the manifest; returns
    ``{"killed": [pid, ...], "removed": [path, ...]}``."""
    try:
        with open(manifest) as f:
            owned = json.load(f)["owned"]
    except (OSError, ValueError, KeyError):
        return {"killed": [], "removed": []}
    out = kill_and_remove(list(owned.values()))
    try:
        os.remove(manifest)
    except FileNotFoundError:
        pass
    return out


def _watch(parent: int, manifest: str) -> None:
    """The watchdog: wait until ``parent`` is gone (or the manifest removed by a clean close), then reap."""
    import psutil

    try:
        start = psutil.Process(parent).create_time()
    except psutil.Error:
        start = None
    while os.path.exists(manifest):
        try:
            p = psutil.Process(parent)
            if start is not None and abs(p.create_time() - start) > 1e-3 or p.status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.Error:
            break
        time.sleep(POLL_S)
    else:
        return  # closed cleanly: nothing left to reap
    reap(manifest)


if __name__ == "__main__":
    if sys.argv[1] == "--detach":  # the intermediate of _spawn_detached: start the watchdog, say its pid, exit
        w = subprocess.Popen(sys.argv[2:], start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, close_fds=True)
        print(w.pid, flush=True)
    else:
        _watch(int(sys.argv[1]), sys.argv[2])
