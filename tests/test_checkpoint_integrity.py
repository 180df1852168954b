"""Checkpoint integrity (``durable/integrity.py``, ``durable/store.py``; issue 30): a checkpoint of a PPO
job written the way the workers write it (one DCP checkpoint per model-stage and rank, ``driver.json``,
the manifest last), then corrupted the ways a user or a disk corrupts it. ``--resume`` refuses each
with one line, before anything starts; the swap of ``current`` is one rename, and a process killed on
either side of it leaves a checkpoint ``--resume`` accepts.

Built in-process (one-worker engines, no Ray): a few seconds."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

from nereus.cli import main  # noqa: E402
from nereus.runtime.comm.instrument import Meter  # noqa: E402
from nereus.runtime.comm.parallel import Layout, build_context  # noqa: E402
from nereus.runtime.durable import store  # noqa: E402
from nereus.runtime.durable import worker_side as dcp_worker  # noqa: E402
from nereus.runtime.durable.integrity import (  # noqa: E402
    MANIFEST,
    job_identity,
    verify_checkpoint,
    write_manifest,
)
from nereus.runtime.worker.engine import AdamConfig, Engine  # noqa: E402
from nereus.spec.presets import MODEL_PRESETS  # noqa: E402
from nereus.spec.workload import WorkloadSpec  # noqa: E402
from nereus.workflow import workflow_for  # noqa: E402

SPEC = MODEL_PRESETS["tiny"]
# the CLI's defaults for --model tiny --task reverse --digits 3 (prompt 5, response 4 tokens)
W = WorkloadSpec(algorithm="ppo", prompts_per_step=8, samples_per_prompt=4, prompt_len=5, response_len=4,
                 mini_batch_size=16, micro_batch_size=4, infer_micro_batch_size=4, reward_model=False)
STEP = 3
UPS = 2  # ppo_epochs 1 x global batch 32 / mini-batch 16 (RLDriver._train)


def _write_checkpoint(directory: str, step: int = STEP) -> None:
    """What ``begin_save`` + ``finish_save`` write, for one-worker layouts: every model-stage's shard,
    its counters (a trainable one last updated at update ``step * UPS``), ``driver.json``, the manifest."""
    updates = step * UPS
    stages = []
    for ms in workflow_for(W).model_stages:
        spec = SPEC if ms.model in ("actor", "reference") else SPEC.value_head()
        m = Meter()
        ctx = build_context(spec, Layout(1, 1, 1, (0,)), 0, None, f"t/{ms.name}", m)
        e = Engine(spec, ctx, {"critic": 1}.get(ms.model, 0), m, ms.trainable, AdamConfig() if ms.trainable else None)
        e.step = e.update_count = e.position = updates if ms.trainable else 0
        dcp_worker.save_engine(e, os.path.join(directory, ms.name, "rank-0"))
        stages.append(ms.name)
    meta = {"step_index": step, "updates": updates, "model_stages": stages, "identity": job_identity(SPEC, W),
            "layouts": {s: {"tp": 1, "pp": 1, "dp": 1, "workers": [0], "replica": 0} for s in stages}}
    with open(os.path.join(directory, "driver.json"), "w") as f:
        json.dump(meta, f)
    write_manifest(directory)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("ckpt") / "slot")
    _write_checkpoint(d)
    return d


@pytest.fixture
def ckpt(pristine, tmp_path) -> str:
    """A checkpoint directory (``--checkpoint-dir``) whose ``current`` is a copy of the pristine one."""
    root = str(tmp_path / "run")
    os.makedirs(root)
    slot = store.new_slot(root, STEP)
    shutil.copytree(pristine, slot)
    store.commit(root, slot)
    return root


def _cur(root: str) -> str:
    return store.current_dir(root)


def _refusal(root: str, capsys) -> str:
    """``nereus run --adaptive --resume``'s stderr: one line, exit status 2, before Ray starts."""
    rc = main(["run", "--adaptive", "--model", "tiny", "--steps", "1", "--checkpoint-dir", root, "--resume",
               "--plot", ""])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, (rc, err)
    return err


def test_an_intact_checkpoint_passes_every_check(ckpt):
    meta = verify_checkpoint(_cur(ckpt), job_identity(SPEC, W))
    assert meta["step_index"] == STEP and meta["updates"] == STEP * UPS
    man = json.load(open(os.path.join(_cur(ckpt), MANIFEST)))
    rel = "actor.train/rank-0/__0_0.distcp"
    data = open(os.path.join(_cur(ckpt), rel), "rb").read()
    assert man["files"][rel] == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    # every file of the checkpoint is listed: 6 model-stages x (.metadata + one data file) + driver.json
    assert len(man["files"]) == 6 * 2 + 1


def test_a_truncated_shard_is_refused(ckpt, capsys):
    p = os.path.join(_cur(ckpt), "critic.train", "rank-0", "__0_0.distcp")
    size = os.path.getsize(p)
    with open(p, "r+b") as f:
        f.truncate(size - 100)
    err = _refusal(ckpt, capsys)
    assert "critic.train/rank-0/__0_0.distcp" in err and f"{size - 100} bytes" in err and str(size) in err


def test_flipped_bytes_in_a_shard_are_refused(ckpt, capsys):
    p = os.path.join(_cur(ckpt), "actor.train", "rank-0", "__0_0.distcp")
    with open(p, "r+b") as f:
        f.seek(os.path.getsize(p) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x01]))
    err = _refusal(ckpt, capsys)
    assert "actor.train/rank-0/__0_0.distcp" in err and "SHA-256" in err


def _swap(root: str, a: str, b: str) -> None:
    cur = _cur(root)
    os.rename(os.path.join(cur, a), os.path.join(cur, "tmp"))
    os.rename(os.path.join(cur, b), os.path.join(cur, a))
    os.rename(os.path.join(cur, "tmp"), os.path.join(cur, b))


def test_swapped_model_stages_are_refused_even_with_a_rewritten_manifest(ckpt, capsys):
    # reference.infer and actor.infer hold tensors of the same names and shapes: only the marker differs
    _swap(ckpt, "actor.infer", "reference.infer")
    assert "actor.infer/rank-0/.metadata" in _refusal(ckpt, capsys)  # the manifest names the first file
    write_manifest(_cur(ckpt))  # someone "repairs" the manifest: the shards still say where they belong
    err = _refusal(ckpt, capsys)
    assert "actor.infer/rank-0 holds the shards of model-stage reference.infer" in err


def test_an_edited_step_is_refused_even_with_a_rewritten_manifest(ckpt, capsys):
    p = os.path.join(_cur(ckpt), "driver.json")
    meta = json.load(open(p))
    meta["step_index"] = STEP + 2
    json.dump(meta, open(p, "w"))
    assert "driver.json does not match its SHA-256" in _refusal(ckpt, capsys)
    write_manifest(_cur(ckpt))
    assert f"says step {STEP + 2} but {STEP * UPS} updates" in _refusal(ckpt, capsys)
    meta["updates"] = (STEP + 2) * UPS  # step and counter edited together: the shards disagree
    json.dump(meta, open(p, "w"))
    write_manifest(_cur(ckpt))
    err = _refusal(ckpt, capsys)
    assert f"saved after update {STEP * UPS}, driver.json says {(STEP + 2) * UPS} updates" in err


def test_a_missing_manifest_is_refused(ckpt, capsys):
    os.remove(os.path.join(_cur(ckpt), MANIFEST))
    assert "no manifest.json" in _refusal(ckpt, capsys)


def test_a_file_added_after_the_save_is_refused(ckpt, capsys):
    shutil.copytree(os.path.join(_cur(ckpt), "actor.train", "rank-0"),
                    os.path.join(_cur(ckpt), "actor.train", "rank-7"))
    err = _refusal(ckpt, capsys)
    assert "actor.train/rank-7/" in err and "not in the manifest" in err


def test_another_models_or_algorithms_checkpoint_is_refused_up_front(ckpt, capsys):
    rc = main(["run", "--adaptive", "--model", "small", "--steps", "1", "--checkpoint-dir", ckpt, "--resume",
               "--plot", ""])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert "written by model 'tiny'; this run uses 'small'" in err
    rc = main(["run", "--adaptive", "--model", "tiny", "--algo", "grpo", "--steps", "1", "--checkpoint-dir", ckpt,
               "--resume", "--plot", ""])
    assert rc == 2 and "written by a PPO run; this run is GRPO" in capsys.readouterr().err
    rc = main(["run", "--adaptive", "--model", "tiny", "--ppo-epochs", "2", "--steps", "1", "--checkpoint-dir", ckpt,
               "--resume", "--plot", ""])
    assert rc == 2 and "2 updates per step; this run makes 4" in capsys.readouterr().err


def test_the_swap_is_one_rename_and_a_kill_on_either_side_leaves_a_valid_checkpoint(ckpt, pristine, tmp_path,
                                                                                     monkeypatch):
    ident = job_identity(SPEC, W)
    old_target = os.readlink(_cur(ckpt))
    new = store.new_slot(ckpt, STEP + 1)
    _write_checkpoint(new, STEP + 1)
    renames = []
    real = os.replace

    def counting(a, b):
        renames.append((os.path.basename(a), os.path.basename(b)))
        return real(a, b)

    # killed before the rename (here: the rename fails): current still is the old, complete checkpoint
    def dies(a, b):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store.os, "replace", dies)
    with pytest.raises(OSError):
        store.commit(ckpt, new)
    assert os.readlink(_cur(ckpt)) == old_target
    assert verify_checkpoint(_cur(ckpt), ident)["step_index"] == STEP
    # killed after the rename, before the clean-up: current is the new one; the old slot is a leftover
    monkeypatch.setattr(store.os, "replace", counting)
    monkeypatch.setattr(store, "cleanup", lambda d: None)
    store.commit(ckpt, new)
    assert renames == [(renames[0][0], "current")] and renames[0][0].endswith(".tmp")  # one rename: the swap
    assert verify_checkpoint(_cur(ckpt), ident)["step_index"] == STEP + 1
    assert os.path.isdir(os.path.join(ckpt, old_target))
    monkeypatch.undo()
    store.cleanup(ckpt)  # what the next run does first
    assert sorted(os.listdir(ckpt)) == sorted(["current", os.path.basename(new)])


def test_an_earlier_versions_current_directory_is_kept_aside(tmp_path, pristine):
    root = str(tmp_path / "r")
    shutil.copytree(pristine, os.path.join(root, "current"))  # a real directory, as before
    new = store.new_slot(root, STEP + 1)
    _write_checkpoint(new, STEP + 1)
    store.commit(root, new)
    assert os.path.islink(store.current_dir(root)) and os.path.isdir(os.path.join(root, "legacy"))


def test_an_unwritable_checkpoint_dir_is_named_in_one_line(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match=r"--checkpoint-dir .*file/sub.*cannot write there"):
        store.check_writable(str(f / "sub"))
    with pytest.raises(ValueError, match=r"MB free, two checkpoints of this job need about"):
        store.check_writable(str(tmp_path / "ok"), need_bytes=1 << 62)


def test_write_errors_read_as_one_line():
    worker_err = RuntimeError("worker 2: background write of /x/rank-2 failed: CheckpointException ranks:{0: "
                              "(RuntimeError('unexpected pos 704 vs 598'), ' File ...\\n OSError: [Errno 28] "
                              "No space left on device')}\nTraceback (most recent call last):\n  ...")
    assert store.write_error(worker_err) == "No space left on device"
    assert store.write_error(PermissionError(13, "Permission denied")) == "Permission denied"
    assert store.write_error(RuntimeError("a\nlast line")) == "last line"


def test_a_failed_write_abandons_that_save_in_one_line_and_keeps_the_previous_checkpoint(ckpt, monkeypatch):
    """A full disk in a writer's background write (the worker's error, as ``finish_save`` raises it):
    the run's checkpointing logs one line, removes the new slot, and ``current`` stays the previous
    checkpoint; the run goes on (no exception)."""
    from nereus.runtime.durable import driver_side as durable
    from nereus.runtime.durable.scheduling import CheckpointingMixin
    from nereus.runtime.worker.failures import WorkerFailure

    class _Worker:
        class dcp_wait:  # noqa: N801  (the shape of a Ray actor method)
            @staticmethod
            def remote(*a):
                return None

    class _Driver:
        workers = [_Worker()]

        def _get(self, futs, what):
            return [None for _ in futs]

    class _Run(CheckpointingMixin):
        pass

    run = _Run()
    lines: list[str] = []
    run.driver, run.log, run.ckpt_dir, run.ckpt_step, run.checkpoints = _Driver(), lines.append, ckpt, STEP, []
    slot = store.new_slot(ckpt, STEP + 1)
    os.makedirs(os.path.join(slot, "actor.train", "rank-0"))
    run._pending = durable.PendingSave(slot, [0], {"step_index": STEP + 1}, True, 0.0)

    def full(driver, pending):
        raise WorkerFailure("dcp save (background write): worker 0: background write of x failed: "
                            "CheckpointException ranks:{0: (RuntimeError('unexpected pos 704 vs 598'), "
                            "'OSError: [Errno 28] No space left on device')}")

    monkeypatch.setattr(durable, "finish_save", full)
    run._complete_save(STEP + 1)
    assert lines == [f"  checkpoint of step {STEP + 1} abandoned (write failed: No space left on device); the "
                     f"checkpoint of step {STEP} stays current"]
    assert not os.path.exists(slot) and run._pending is None
    assert verify_checkpoint(_cur(ckpt), job_identity(SPEC, W))["step_index"] == STEP

