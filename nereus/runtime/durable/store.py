"""The checkpoint directory of an adaptive run: slots and the one-rename swap (driver side).

Layout of ``<checkpoint_dir>``::

    current -> slot-000012-1      a symbolic link (relative) to the complete checkpoint in effect
    slot-000012-1/                one complete checkpoint (``driver_side`` format, ``manifest.json`` last)
    slot-000015-2/                a save being written (not yet complete)

A save is written into a fresh slot (:func:`new_slot`); once every writer is done and the manifest
is written, :func:`commit` points ``current`` at it with ONE ``os.replace`` of a new link over the
old one (POSIX ``rename(2)`` replaces the link atomically), then removes the other slots. A process
killed at any point leaves ``current`` pointing at a complete checkpoint: before the rename the old
one, after it the new one; slots that are not ``current``'s target are leftovers that
:func:`cleanup` removes (and ``--resume`` never reads). Earlier versions kept ``current`` as a real
directory and swapped it with two renames (``next`` -> ``current`` -> ``old``); :func:`commit` moves
such a directory aside to ``legacy`` once, never deleting it.
"""

from __future__ import annotations

import itertools
import os
import shutil

__all__ = ["CURRENT", "new_slot", "commit", "current_dir", "cleanup", "check_writable", "write_error"]

CURRENT = "current"
_SLOT = "slot-"
_counter = itertools.count(1)


def current_dir(ckpt_dir: str) -> str:
    """``<ckpt_dir>/current``: the complete checkpoint in effect (the link; it resolves to a slot)."""
    return os.path.join(ckpt_dir, CURRENT)


def new_slot(ckpt_dir: str, step_index: int) -> str:
    """A fresh, empty slot directory for the checkpoint of boundary ``step_index`` (not yet created)."""
    while True:
        path = os.path.join(ckpt_dir, f"{_SLOT}{int(step_index):06d}-{os.getpid()}-{next(_counter)}")
        if not os.path.lexists(path):
            return path


def _target(ckpt_dir: str) -> str | None:
    cur = current_dir(ckpt_dir)
    if os.path.islink(cur):
        return os.path.basename(os.readlink(cur))
    return None


def commit(ckpt_dir: str, slot: str) -> None:
    """Make ``slot`` (complete, under ``ckpt_dir``) the current checkpoint with one rename, then remove
    the other slots (module docstring).

    Raises:
        OSError: the link could not be made or renamed (``current`` is then unchanged).
    """
    cur = current_dir(ckpt_dir)
    if os.path.isdir(cur) and not os.path.islink(cur):  # an earlier version's directory: keep it aside
        os.replace(cur, os.path.join(ckpt_dir, "legacy"))
    tmp = os.path.join(ckpt_dir, f".{CURRENT}.{os.getpid()}.tmp")
    if os.path.lexists(tmp):
        os.remove(tmp)
    os.symlink(os.path.basename(slot), tmp)
    os.replace(tmp, cur)  # the swap: one rename
    cleanup(ckpt_dir)


def cleanup(ckpt_dir: str) -> None:
    """Remove every slot that is not ``current``'s target, and stale link files (what a process killed
    during a save or between the rename and the clean-up leaves)."""
    if not os.path.isdir(ckpt_dir):
        return
    keep = _target(ckpt_dir)
    for name in os.listdir(ckpt_dir):
        path = os.path.join(ckpt_dir, name)
        if name.startswith(_SLOT) and name != keep:
            shutil.rmtree(path, ignore_errors=True)
        elif name.startswith(f".{CURRENT}.") and name.endswith(".tmp"):
            try:
                os.remove(path)
            except OSError:
                pass


def check_writable(ckpt_dir: str, need_bytes: int = 0) -> None:
    """Before anything starts: ``ckpt_dir`` can be created and written, and its file system has
    ``need_bytes`` free (two checkpoints' worth: the new one is written before the old one goes).

    Raises:
        ValueError: one line naming the directory and the reason (permission, read-only file system,
            not a directory, too little free space).
    """
    try:
        os.makedirs(ckpt_dir, exist_ok=True)
        probe = os.path.join(ckpt_dir, f".write-probe-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("x")
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"--checkpoint-dir {ckpt_dir!r}: cannot write there ({e.strerror or e})") from None
    if need_bytes > 0:
        free = shutil.disk_usage(ckpt_dir).free
        if free < need_bytes:
            raise ValueError(f"--checkpoint-dir {ckpt_dir!r}: {free / 1e6:.1f} MB free, two checkpoints of this "
                             f"job need about {need_bytes / 1e6:.1f} MB")


#: the errno texts a failed write names (``strerror`` of ENOSPC, EDQUOT, EACCES, EROFS, EPERM)
_KNOWN = ("No space left on device", "Disk quota exceeded", "Permission denied", "Read-only file system",
          "Operation not permitted")


def write_error(e: BaseException) -> str:
    """One line for a failed checkpoint write: the operating system's reason when the error (or a
    worker's wrapped one) names a known one, else the error's last line, at most 200 characters."""
    text = str(e)
    for k in _KNOWN:
        if k in text:
            return k
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return (lines[-1] if lines else type(e).__name__)[:200]
