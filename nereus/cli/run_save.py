"""``nereus run --save DIR``: the trained actor (and critic, ``DIR/critic``) as Hugging Face directories,
for the fixed, adaptive and asynchronous runs alike.

:func:`check_save_target` runs before Ray starts (a target that cannot be written must not waste a
training run); :func:`save_hf` writes replica 0 of each training model-stage at the end
(``WorkerCore.save_hf``: one ``model-0000p-of-0000P.safetensors`` per PP rank, the index and
``config.json``) and then removes weight files of an earlier model in the same directory that the new
index does not name (a stale ``model.safetensors`` would otherwise be what ``from_pretrained`` loads:
Transformers reads ``model.safetensors`` before the index).
"""

from __future__ import annotations

import json
import os

__all__ = ["check_save_target", "save_hf", "remove_stale_weights"]

_STAGES = (("actor.train", ""), ("critic.train", "critic"))


def check_save_target(directory: str | None, spec=None, model: str | None = None) -> None:
    """``--save DIR`` can be written: not an existing file, not the ``--model`` directory it reads
    from (its weights would be replaced while the run's tokenizer and config still come from there),
    and its nearest existing parent writable.

    Raises:
        ValueError: naming ``--save``, the path and the reason.
    """
    if not directory:
        return
    path = os.path.abspath(directory)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"--save {directory!r} is an existing file; give a directory (it is created if missing)")
    sources = [getattr(spec, "checkpoint", None), model]  # the weights' directory; --model DIR (or its config)
    sources = [os.path.dirname(s) if s and os.path.isfile(s) else s for s in sources]
    if any(s and os.path.isdir(s) and os.path.realpath(s) == os.path.realpath(path) for s in sources):
        raise ValueError(f"--save {directory!r} is the --model directory the run reads its weights from; "
                         "save into another directory")
    parent = path
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.access(parent, os.W_OK):
        raise ValueError(f"--save {directory!r}: {parent!r} is not writable")


def remove_stale_weights(directory: str) -> list[str]:
    """Delete the ``*.safetensors`` files in ``directory`` that its ``model.safetensors.index.json``
    does not name (weights of an earlier model saved there); returns their names.

    Raises:
        ValueError: the index is missing or unreadable (nothing is deleted then).
    """
    idx = os.path.join(directory, "model.safetensors.index.json")
    try:
        with open(idx) as f:
            named = set(json.load(f)["weight_map"].values())
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"--save: {idx} unreadable after the save ({e})") from None
    stale = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors") and n not in named)
    for n in stale:
        os.remove(os.path.join(directory, n))
    return stale


def save_hf(driver, directory: str, log=print) -> None:
    """Write replica 0 of actor.train (and critic.train into ``directory/critic``) of a started driver
    as Hugging Face directories, then :func:`remove_stale_weights` in each."""
    for ms, sub in _STAGES:
        if ms not in driver.layouts:
            continue
        d = os.path.join(directory, sub) if sub else directory
        lay = driver.layouts[ms]
        n = sum(driver._get([driver.workers[i].save_hf.remote(ms, d) for i in lay.replica(0)], f"saving {ms}"))
        stale = remove_stale_weights(d)
        log(f"wrote {ms} to {d} ({n / 1e6:.1f} MB)" + (f"; removed the earlier weights {', '.join(stale)}"
                                                      if stale else ""))
