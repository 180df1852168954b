"""Checkpoint integrity: the manifest, the job identity, and the checks ``--resume`` makes before
it reads a checkpoint (driver side; no Ray, no process group).

**Manifest.** ``<checkpoint>/manifest.json`` is written LAST (after every writer's files and
``driver.json``; through a temporary file and one ``os.replace``), so a checkpoint without it is
incomplete. It lists every other file under the checkpoint with its size in bytes and its SHA-256
(``hashlib``), and nothing else is read on resume: a file not listed is refused too (a stray
``rank-*`` directory would otherwise be read as a saved piece).

**Identity.** ``driver.json`` carries ``identity`` (:func:`job_identity`): the model's name, the
algorithm, the workflow's model-stages and the full shape of every parameter of each model
(``model.sharding.param_shapes``). ``--resume`` compares it field by field with the run's own.

**Against the shards.** Each saving worker's DCP checkpoint holds a marker key
``model_stage:<name>`` (``durable/worker_side.py``), so a rank directory moved under another
model-stage is refused even when the manifest was rewritten to match; every piece key must name a
parameter of that model-stage's model within its shape; and the counters of every trainable
model-stage (``position``: the driver's update counter at its last update) must equal
``driver.json``'s ``updates``, which must equal ``step_index`` times the updates per step.

**What this does not protect.** The manifest is a checksum list, not a signature: it detects
truncation, flipped bits, swapped or edited files and an interrupted write, not a checkpoint made or
rewritten on purpose. DCP's ``.metadata`` is a Python pickle: reading it (which the shard checks here
and every ``dcp.load`` do) can execute code, so only load checkpoints from a source you trust
(docs/faults.md).
"""

from __future__ import annotations

import hashlib
import json
import os

__all__ = ["MANIFEST", "CheckpointRefused", "write_manifest", "verify_manifest", "job_identity",
           "verify_checkpoint", "updates_per_step", "MARKER"]

MANIFEST = "manifest.json"
FORMAT = 1
MARKER = "model_stage:"  # the DCP key prefix of the model-stage marker each rank directory holds
_CHUNK = 1 << 20


class CheckpointRefused(ValueError):
    """``--resume`` will not read this checkpoint; the message is one line saying why."""


def _digest(path: str) -> tuple[int, str]:
    h = hashlib.sha256()
    n = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            n += len(chunk)
    return n, h.hexdigest()


def _files(directory: str) -> list[str]:
    out = []
    for root, dirs, names in os.walk(directory):
        dirs.sort()
        for n in sorted(names):
            rel = os.path.relpath(os.path.join(root, n), directory)
            if rel != MANIFEST and not n.endswith(".tmp"):
                out.append(rel)
    return out


def write_manifest(directory: str) -> dict:
    """Write ``<directory>/manifest.json`` (every other file's size and SHA-256), last and atomically.

    Returns:
        the manifest: ``{"format": 1, "files": {relative path: {"size": bytes, "sha256": hex}}}``.
    """
    files = {}
    for rel in _files(directory):
        size, sha = _digest(os.path.join(directory, rel))
        files[rel] = {"size": size, "sha256": sha}
    man = {"format": FORMAT, "files": files}
    tmp = os.path.join(directory, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(man, f, indent=0, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, MANIFEST))
    return man


def verify_manifest(directory: str) -> dict:
    """Every file the manifest lists is there with its size and SHA-256, and no other file is.

    Returns:
        the manifest.

    Raises:
        CheckpointRefused: one line naming the first file that differs (or the missing manifest).
    """
    path = os.path.join(directory, MANIFEST)
    if not os.path.isdir(directory):
        raise CheckpointRefused(f"no checkpoint at {directory}")
    if not os.path.isfile(path):
        raise CheckpointRefused(f"{directory}: no {MANIFEST} (an incomplete checkpoint, or one written before "
                                "manifests); refusing to resume from it")
    try:
        with open(path) as f:
            man = json.load(f)
        files = dict(man["files"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointRefused(f"{path}: unreadable manifest ({e})") from None
    for rel, want in sorted(files.items()):
        p = os.path.join(directory, rel)
        if not os.path.isfile(p):
            raise CheckpointRefused(f"{directory}: {rel} is listed in the manifest but missing")
        size = os.path.getsize(p)
        if size != want["size"]:
            raise CheckpointRefused(f"{directory}: {rel} has {size} bytes, the manifest says {want['size']} "
                                    "(truncated or replaced)")
        if _digest(p)[1] != want["sha256"]:
            raise CheckpointRefused(f"{directory}: {rel} does not match its SHA-256 in the manifest "
                                    "(corrupted or edited)")
    extra = [rel for rel in _files(directory) if rel not in files]
    if extra:
        raise CheckpointRefused(f"{directory}: {extra[0]} is not in the manifest (a file added after the save)")
    return man


def updates_per_step(workload) -> int:
    """Optimizer updates per RL step: ``ppo_epochs × global_batch / mini_batch`` (``RLDriver._train``)."""
    return int(workload.ppo_epochs * (workload.global_batch // workload.mini_batch_size))


def job_identity(spec, workload) -> dict:
    """What a checkpoint must match to be resumed by this job (module docstring): the model name,
    the algorithm, the workflow's model-stages (with the model each runs) and every parameter's full
    shape per model (the actor and reference: ``spec``; critic and reward: ``spec.value_head()``, as
    ``RLDriver._spec_of``)."""
    from nereus.runtime.model.sharding import param_shapes
    from nereus.workflow import workflow_for

    wf = workflow_for(workload)
    models = {}
    for ms in wf.model_stages:
        if ms.model not in models:
            s = spec if ms.model in ("actor", "reference") else spec.value_head()
            models[ms.model] = {n: list(shape) for n, (shape, _) in param_shapes(s).items()}
    return {"model": spec.name, "algorithm": workload.algorithm,
            "model_stages": {ms.name: ms.model for ms in wf.model_stages},
            "trainable": sorted(ms.name for ms in wf.model_stages if ms.trainable),
            "updates_per_step": updates_per_step(workload), "shapes": models}


def _compare_identity(directory: str, saved: dict, want: dict) -> None:
    if saved.get("model") != want["model"]:
        raise CheckpointRefused(f"{directory} was written by model {saved.get('model')!r}; this run uses "
                                f"{want['model']!r}")
    if saved.get("algorithm") != want["algorithm"]:
        raise CheckpointRefused(f"{directory} was written by a {str(saved.get('algorithm')).upper()} run; this run "
                                f"is {want['algorithm'].upper()}")
    if saved.get("model_stages") != want["model_stages"]:
        raise CheckpointRefused(f"{directory} holds model-stages {sorted(saved.get('model_stages') or {})}; this "
                                f"run's workflow has {sorted(want['model_stages'])}")
    for model, shapes in want["shapes"].items():
        got = (saved.get("shapes") or {}).get(model, {})
        for name, shape in shapes.items():
            if got.get(name) != shape:
                raise CheckpointRefused(f"{directory}: {model} parameter {name} has shape {got.get(name)} there, "
                                        f"{shape} in this run's model")
    if saved.get("updates_per_step") != want["updates_per_step"]:
        raise CheckpointRefused(f"{directory} was written with {saved.get('updates_per_step')} updates per step; "
                                f"this run makes {want['updates_per_step']} (--ppo-epochs, --prompts, --samples, "
                                "--mini-batch)")


def _check_rank(directory: str, stage: str, rank_dir: str, shapes: dict, trainable: bool, updates: int) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from nereus.runtime.durable.worker_side import _COUNTERS, parse_key

    rel = os.path.relpath(rank_dir, directory)
    try:
        md = FileSystemReader(rank_dir).read_metadata()  # a pickle: verified against the manifest first
    except Exception as e:  # noqa: BLE001  (any unreadable metadata is a refusal, in one line)
        raise CheckpointRefused(f"{directory}: {rel}/.metadata unreadable ({type(e).__name__})") from None
    keys = set(md.state_dict_metadata)
    markers = sorted(k[len(MARKER):] for k in keys if k.startswith(MARKER))
    if markers != [stage]:
        raise CheckpointRefused(f"{directory}: {rel} holds the shards of model-stage "
                                f"{markers[0] if markers else '(unmarked)'!s}, not {stage}")
    for key in sorted(keys):
        if key == "counters" or key.startswith(MARKER):
            continue
        try:
            _, name, dim, lo, hi = parse_key(key)
        except ValueError:
            raise CheckpointRefused(f"{directory}: {rel} holds an unknown key {key!r}") from None
        if name not in shapes or (dim is not None and not (dim < len(shapes[name]) and 0 <= lo < hi <= shapes[name][dim])):
            raise CheckpointRefused(f"{directory}: {rel} piece {key} is not part of {stage}'s model")
    if "counters" not in keys:
        raise CheckpointRefused(f"{directory}: {rel} has no counters")
    if trainable:
        c = torch.zeros(len(_COUNTERS), dtype=torch.int64)
        dcp.load({"counters": c}, checkpoint_id=rank_dir, no_dist=True)
        pos = int(c[_COUNTERS.index("position")])
        if pos != updates:
            raise CheckpointRefused(f"{directory}: {rel} was saved after update {pos}, driver.json says "
                                    f"{updates} updates (edited, or shards of another step)")


def verify_checkpoint(directory: str, identity: dict | None = None) -> dict:
    """Everything ``--resume`` checks before it reads ``directory`` (module docstring): the manifest,
    ``driver.json`` and its identity against ``identity`` (from :func:`job_identity`; None: not
    compared), its step against its update counter, and each saved rank directory's marker, piece
    keys and counters.

    Returns:
        ``driver.json``'s content.

    Raises:
        CheckpointRefused: one line saying what does not match.
    """
    verify_manifest(directory)
    try:
        with open(os.path.join(directory, "driver.json")) as f:
            meta = json.load(f)
        step, updates, stages = int(meta["step_index"]), int(meta["updates"]), list(meta["model_stages"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointRefused(f"{directory}: driver.json unreadable ({e})") from None
    saved_id = meta.get("identity")
    if saved_id is None:
        raise CheckpointRefused(f"{directory}: driver.json has no job identity (written before identities)")
    if identity is not None:
        _compare_identity(directory, saved_id, identity)
    ups = int(saved_id.get("updates_per_step", 0))
    if updates != step * ups:
        raise CheckpointRefused(f"{directory}: driver.json says step {step} but {updates} updates; {ups} per step "
                                f"make {step * ups} (edited)")
    trainable = set(saved_id.get("trainable", []))
    for stage in stages:
        model = saved_id["model_stages"].get(stage)
        shapes = saved_id["shapes"].get(model, {})
        sdir = os.path.join(directory, stage)
        ranks = sorted(n for n in os.listdir(sdir) if n.startswith("rank-")) if os.path.isdir(sdir) else []
        if not ranks:
            raise CheckpointRefused(f"{directory}: no shards of {stage}, which driver.json lists as saved")
        for n in ranks:
            _check_rank(directory, stage, os.path.join(sdir, n), shapes, stage in trainable, updates)
    return meta
