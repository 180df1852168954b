"""Checkpoint/restart through torch.distributed.checkpoint (runtime/durable/driver_side.py): each worker writes
its own shards, a restart in another layout reads only the pieces of each new shard, and the logical
state comes back bit for bit; training continues as without the restart."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")

from nereus.runtime.durable import driver_side as durable  # noqa: E402
from nereus.runtime.durable import worker_side as dcp_worker  # noqa: E402
from nereus.runtime.rl.task import DigitTask  # noqa: E402
from nereus.runtime.run.config import RLConfig  # noqa: E402
from nereus.runtime.run.driver import RLDriver  # noqa: E402
from nereus.runtime.run.pool import WorkerPool  # noqa: E402
from nereus.spec.plan import Candidate, Plan  # noqa: E402
from nereus.spec.presets import MODEL_PRESETS  # noqa: E402
from nereus.spec.workload import WorkloadSpec  # noqa: E402

SPEC = MODEL_PRESETS["tiny"]
TASK = DigitTask("reverse", 3)
W = WorkloadSpec(algorithm="ppo", prompts_per_step=4, samples_per_prompt=2, prompt_len=5, response_len=4,
                 mini_batch_size=4, micro_batch_size=1, infer_micro_batch_size=4, reward_model=False)
CFG = RLConfig(actor_lr=1e-2, critic_lr=1e-2, timeout_s=30)
BASE = {"actor.generate": (1, 1, 2, (0, 1)), "actor.infer": (1, 1, 1, (0,)), "reference.infer": (1, 2, 1, (1, 2)),
        "critic.infer": (1, 1, 1, (3,)), "actor.train": (2, 1, 1, (0, 1)), "critic.train": (1, 2, 1, (2, 3))}
TRAIN = ("actor.train", "critic.train")
KINDS = ("params", "exp_avg", "exp_avg_sq")
COUNTERS = ("step", "update_count", "version", "policy_version", "position")


def plan(**changes) -> Plan:
    lay = {**BASE, **{k.replace("_", "."): v for k, v in changes.items()}}
    return Plan(candidates=tuple(Candidate(ms, tp, pp, dp, micro_batch=1 if not ms.endswith("generate") else 0,
                                           gpus=gpus) for ms, (tp, pp, dp, gpus) in lay.items()))


def test_piece_keys_round_trip():
    for args in (("params", "model.layers.0.self_attn.q_proj.weight", 0, 4, 8),
                 ("exp_avg_sq", "model.layers.3.mlp.down_proj.weight", 1, 0, 64),
                 ("exp_avg", "model.norm.weight", None, 0, 0)):
        assert dcp_worker.parse_key(dcp_worker.piece_key(*args)) == args
    with pytest.raises(ValueError):
        dcp_worker.parse_key("params/x/1:2")


def _states(d: RLDriver) -> dict:
    return {n: d.gather_logical_state(n) for n in TRAIN}


def _assert_equal(a: dict, b: dict, what: str) -> None:
    for ms in TRAIN:
        for kind in KINDS:
            assert a[ms][kind].keys() == b[ms][kind].keys()
            for n in a[ms][kind]:
                assert torch.equal(a[ms][kind][n], b[ms][kind][n]), (what, ms, kind, n)
        for k in COUNTERS:
            assert a[ms][k] == b[ms][k], (what, ms, k)


def _shard_bytes(d: RLDriver, ms: str) -> int:
    """State bytes every rank of every replica of ``ms`` holds (vocab padding excluded)."""
    from nereus.runtime.model.sharding import names_of_stage, param_shapes
    from nereus.runtime.transit.plans import region

    wf = next(m for m in d.wf.model_stages if m.name == ms)
    spec, lay = d._spec_of(wf.model), d.layouts[ms]
    shapes = param_shapes(spec)
    total = 0
    for _ in range(lay.dp):
        for p in range(lay.pp):
            for t in range(lay.tp):
                for n in names_of_stage(spec, lay.pp, p):
                    shape, r = list(shapes[n][0]), region(spec, n, lay.tp, t)
                    if r.dim is not None:
                        shape[r.dim] = r.hi - r.lo
                    total += 4 * int(torch.Size(shape).numel()) * (3 if wf.trainable else 1)
    return total


@pytest.mark.slow
def test_restart_in_another_layout_keeps_state_bit_for_bit_and_training_continues(pool, tmp_path):
    # reference: two steps without a restart
    ref = RLDriver(SPEC, W, plan(), TASK, 4, CFG).start(pool)
    try:
        ref.step()
        ref.step()
        want = _states(ref)
    finally:
        ref.close()
    d = RLDriver(SPEC, W, plan(), TASK, 4, CFG).start(pool)
    try:
        d.step()
        before = _states(d)
        saved = durable.save(d, str(tmp_path))
        # only replica 0's ranks write, and each writes its own shards: the state bytes of the two
        # training EMUs are their full sizes (params + 2 moments), the frozen/inference copies once
        full = {ms: sum(t.numel() * 4 for kind in KINDS for t in before[ms][kind].values()) for ms in TRAIN}
        assert saved["state"] >= sum(full.values())
        assert saved["written"] >= saved["state"]
        for ms in TRAIN:
            ranks = sorted(os.listdir(tmp_path / ms))
            assert ranks == [f"rank-{w}" for w in d.layouts[ms].replica(0)], (ms, ranks)
        # actor.train TP 2 -> PP 2 and DP 1 -> 2; critic.train PP 2 -> TP 2 on other workers
        target = plan(actor_train=(1, 2, 2, (0, 1, 2, 3)), critic_train=(2, 1, 1, (0, 1)),
                      actor_generate=(2, 1, 1, (2, 3)))
        got = durable.restart(d, str(tmp_path), target)
        assert d.layouts["actor.train"].dp == 2 and d.layouts["actor.train"].pp == 2
        assert d.layouts["critic.train"].tp == 2
        assert got["loaded"] > 0 and got["read"] >= got["loaded"]
        # each new rank copied exactly its shard: the loaded state bytes are the new layouts' sizes
        # (actor.train twice: two replicas)
        if not torch.cuda.is_available():  # fp32 everywhere (a GPU keeps frozen copies in bf16)
            assert got["loaded"] == sum(_shard_bytes(d, ms) for ms in d.layouts)
        _assert_equal(_states(d), before, "restart")
        r1 = d.gather_logical_state("actor.train", 1)
        for kind in KINDS:
            for n, t in before["actor.train"][kind].items():
                assert torch.equal(r1[kind][n], t), ("replica 1", kind, n)
        d.step()
        got_after = _states(d)
    finally:
        d.close()
    for ms in TRAIN:  # same samples, same updates up to fp32 reduction order
        assert got_after[ms]["update_count"] == want[ms]["update_count"]
        assert got_after[ms]["position"] == want[ms]["position"]
        for n in want[ms]["params"]:
            assert torch.allclose(got_after[ms]["params"][n], want[ms]["params"][n], atol=1e-5, rtol=1e-4), (ms, n)


@pytest.mark.slow
def test_bf16_restart_saves_and_loads_every_kind_bit_for_bit(pool, tmp_path):
    """A bf16 run saves bf16 weights, the fp32 master and fp32 moments; a restart in another layout
    reads them back bit for bit, each kind in its own dtype (2 + 4 + 8 bytes per trained parameter)."""
    d = RLDriver(SPEC, W, plan(), TASK, 4, dataclasses.replace(CFG, precision="bf16")).start(pool)
    kinds = KINDS + ("master",)
    try:
        d.step()
        before = _states(d)
        saved = durable.save(d, str(tmp_path))
        n_train = {ms: sum(t.numel() for t in before[ms]["params"].values()) for ms in TRAIN}
        assert saved["state"] >= sum(14 * n for n in n_train.values())
        target = plan(actor_train=(1, 2, 2, (0, 1, 2, 3)), critic_train=(2, 1, 1, (0, 1)),
                      actor_generate=(2, 1, 1, (2, 3)))
        durable.restart(d, str(tmp_path), target)
        after = _states(d)
        for ms in TRAIN:
            for kind in kinds:
                for n, t in before[ms][kind].items():
                    assert torch.equal(after[ms][kind][n], t), (ms, kind, n)
            for k in COUNTERS:
                assert after[ms][k] == before[ms][k], (ms, k)
        d.step()
        st = d.gather_logical_state("actor.train", 1)
        assert all(torch.equal(w, st["master"][n].to(torch.bfloat16).float()) for n, w in st["params"].items())
    finally:
        d.close()


@pytest.mark.slow
def test_restart_refuses_a_layout_change_of_a_model_stage_that_was_not_saved(pool, tmp_path):
    d = RLDriver(SPEC, W, plan(), TASK, 4, CFG).start(pool)
    try:
        d.step()
        before = _states(d)
        durable.save(d, str(tmp_path), ["actor.train"])
        with pytest.raises(ValueError, match="critic.train"):
            durable.restart(d, str(tmp_path), plan(actor_train=(1, 1, 1, (0,)), critic_train=(2, 1, 1, (2, 3))))
        assert d.layouts["actor.train"].tp == 2  # nothing changed
        _assert_equal(_states(d), before, "refused")
        durable.restart(d, str(tmp_path), plan(actor_train=(1, 1, 1, (3,))))
        _assert_equal(_states(d), before, "actor only")
        d.step()
    finally:
        d.close()


def test_live_transition_doc_is_self_contained():
    import re
    from pathlib import Path

    doc = Path(__file__).resolve().parent.parent / "docs" / "live-transition.md"
    text = doc.read_text()
    for link in re.findall(r"\]\(([^)#]+)\)", text):
        assert not link.startswith("http"), link
        assert (doc.parent / link).exists(), link
    for path in re.findall(r"`((?:nereus|benchmarks|tests)/[\w/.-]+\.py)`", text):
        assert (doc.parent.parent / path).exists(), path


# ------------------------------------------------------------------------------ asynchronous saves
class _FakeEngine:
    """What ``dcp_worker.save_engine_async``/``load_engine`` touch of an engine: TP rank ``t`` of 2 of the
    tiny spec's shards (column pieces of row-parallel weights too), Adam's moments and counters."""

    def __init__(self, t: int, seed: int) -> None:
        import types

        from nereus.runtime.model.sharding import param_shapes
        from nereus.runtime.transit.plans import region

        g = torch.Generator().manual_seed(seed)
        self.spec, self.ctx = SPEC, types.SimpleNamespace(tp=2, t=t, p=0)
        shapes = param_shapes(SPEC)
        self.model = types.SimpleNamespace(names=list(shapes))
        self.kinds: dict = {}
        for kind in KINDS:
            self.kinds[kind] = {}
            for n, (shape, _) in shapes.items():
                r, shape = region(SPEC, n, 2, t), list(shape)
                if r.dim is not None:
                    shape[r.dim] = r.length
                self.kinds[kind][n] = torch.randn(*shape, generator=g)
        for i, k in enumerate(COUNTERS):
            setattr(self, k, 10 + i)

    def state_tensors(self) -> dict:
        return self.kinds


def test_async_save_writes_the_snapshot_not_the_tensors_changed_after_it(tmp_path):
    """``save_engine_async`` returns once its snapshot is taken; the engine's tensors are then changed
    in place (as the next training step does) while the background write is held back; the files
    hold the state at the save, as a synchronous save of it does."""
    import threading

    e = _FakeEngine(1, 0)
    ref = str(tmp_path / "sync")
    dcp_worker.save_engine(e, ref)  # the reference: a synchronous save of the same state
    gate, started = threading.Event(), threading.Event()

    def hold(phase: str) -> None:  # in the background thread, before DCP writes the data file
        if phase == "data":
            started.set()
            assert gate.wait(30)

    h = dcp_worker.save_engine_async(e, str(tmp_path / "async" / "rank-0"), hook=hold)
    assert h["snapshot_s"] >= 0 and h["state"] > 0
    assert started.wait(30)  # the write is in flight ...
    for tensors in e.kinds.values():  # ... while "training" changes every tensor and counter in place
        for t in tensors.values():
            t.mul_(-2.0).add_(1.0)
    for k in COUNTERS:
        setattr(e, k, getattr(e, k) + 100)
    gate.set()
    done = dcp_worker.wait_engine_save(h, 60)
    assert done["written"] > done["state"] == h["state"] and done["write_s"] >= 0
    got, want = _FakeEngine(1, 1), _FakeEngine(1, 2)
    dcp_worker.load_engine(got, str(tmp_path / "async"))
    os.makedirs(tmp_path / "ref")
    os.rename(ref, tmp_path / "ref" / "rank-0")
    dcp_worker.load_engine(want, str(tmp_path / "ref"))
    for kind in KINDS:
        for n, t in want.kinds[kind].items():
            assert torch.equal(got.kinds[kind][n], t), (kind, n)
            assert not torch.equal(got.kinds[kind][n], e.kinds[kind][n]), (kind, n)
    assert [getattr(got, k) for k in COUNTERS] == [10 + i for i in range(len(COUNTERS))]


def test_a_failed_background_write_is_reported_when_waited_for(tmp_path):
    def fail(phase: str) -> None:
        raise OSError("disk full")

    h = dcp_worker.save_engine_async(_FakeEngine(0, 0), str(tmp_path / "x"), hook=fail)
    with pytest.raises(RuntimeError, match="disk full"):
        dcp_worker.wait_engine_save(h, 60)


@pytest.mark.slow
def test_async_save_then_training_restores_the_state_at_the_save(pool, tmp_path):
    """A background save at a step boundary, two training steps while it writes, then a restore in
    another layout: the state at the boundary, bit for bit, the same as restoring a synchronous save
    of the same boundary; not the state the steps reached. The blocking part (the snapshot) is
    reported apart from the background write."""
    d = RLDriver(SPEC, W, plan(), TASK, 4, CFG).start(pool)
    try:
        d.step()
        at_save = _states(d)
        sync_info = durable.save(d, str(tmp_path / "sync"))
        pending = durable.begin_save(d, str(tmp_path / "async"), background=True)
        assert pending.background and pending.step_index == 1 and pending.blocking_s >= 0
        assert not os.path.exists(tmp_path / "async" / "driver.json")  # not complete yet
        d.step()
        d.step()
        later = _states(d)
        info = durable.finish_save(d, pending)
        assert os.path.exists(tmp_path / "async" / "driver.json")
        # the blocking part and the background part are reported apart
        assert info["background"] and not sync_info["background"]
        for k in ("blocking_s", "snapshot_s", "background_s", "wait_s", "seconds"):
            assert info[k] >= 0 and sync_info[k] >= 0, k
        assert info["seconds"] == pytest.approx(info["blocking_s"] + info["wait_s"])
        assert sync_info["background_s"] == 0 and sync_info["wait_s"] == 0
        assert sync_info["seconds"] == sync_info["blocking_s"]
        assert info["state"] == sync_info["state"] and info["saved"] == sync_info["saved"]
        assert set(info["per_worker"]) == set(sync_info["per_worker"])
        target = plan(actor_train=(1, 2, 2, (0, 1, 2, 3)), critic_train=(2, 1, 1, (0, 1)),
                      actor_generate=(2, 1, 1, (2, 3)))
        durable.restart(d, str(tmp_path / "async"), target)
        assert d.step_index == 1
        from_async = _states(d)
        durable.restart(d, str(tmp_path / "sync"), target)
        from_sync = _states(d)
    finally:
        d.close()
    _assert_equal(from_async, from_sync, "async vs sync save of the same boundary")
    _assert_equal(from_async, at_save, "async save vs the state at the boundary")
    assert later["actor.train"]["update_count"] == at_save["actor.train"]["update_count"] + 4
    assert any(not torch.equal(later["actor.train"]["params"][n], t)
               for n, t in at_save["actor.train"]["params"].items())


def _adaptive_run(steps: int, faults_at=None, **kw):
    """A 4-worker adaptive PPO run with a checkpoint at every boundary, on a pool of its own; at
    ``faults_at = (step, how)`` the first writer of ``actor.train`` is armed to fail in the
    background write of the checkpoint taken after that step."""
    from nereus.runtime.run.adaptive import AdaptiveRun

    kw.setdefault("framework", "nereus")  # the disjoint space, where every recovery runs live (docs/faults.md)
    p = WorkerPool(4, timeout_s=15, hang_timeout_s=3).start()
    lines: list[str] = []
    run = AdaptiveRun(SPEC, W, TASK, 4, RLConfig(actor_lr=1e-2, critic_lr=1e-2, timeout_s=15), hang_timeout_s=3,
                      log=lines.append, measure=False, checkpoint_every=1, **kw)
    run.keep_final = True
    if faults_at is not None:
        step, how = faults_at

        def arm(k: int) -> None:
            if k == step:
                run.victim = run.driver.layouts["actor.train"].replica(0)[0]
                run.faults[k] = ("dcp_save", run.victim, how)
        run.before_step = arm
    try:
        hist = run.run(steps, p)
    finally:
        p.close()
    return run, hist, lines


@pytest.fixture(scope="module")
def async_reference(pool):
    """The fault-free run (asynchronous checkpoints) the faulty ones must match."""
    return _adaptive_run(3)


@pytest.mark.slow
def test_adaptive_checkpoints_report_blocking_and_background_parts(async_reference):
    run, hist, lines = async_reference
    assert [m["update_count"] for m in hist] == [2, 4, 6]
    ck = run.checkpoints
    assert [c["step"] for c in ck] == [0, 1, 2, 3]  # before step 0, then after every step
    assert not ck[0]["background"] and all(c["background"] for c in ck[1:])  # the first one is synchronous
    for c in ck:
        assert {"blocking_s", "snapshot_s", "background_s", "wait_s", "seconds", "written", "state"} <= set(c)
        assert c["seconds"] == pytest.approx(c["blocking_s"] + c["wait_s"])
        assert c["written"] > c["state"] > 0
    assert ck[0]["background_s"] == 0 and all(c["background_s"] > 0 for c in ck[1:])
    assert any("writing in the background" in s for s in lines)
    assert any("(snapshot), background" in s for s in lines)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_writer_lost_in_the_background_write_leaves_the_previous_checkpoint(async_reference, how):
    """The first writer of actor.train dies (or hangs, SIGSTOP) in the background write of the
    checkpoint taken after step 1, while step 2 runs: the run detects it, abandons that checkpoint
    (the one of step 1 stays current), recovers and ends with the fault-free run's weights."""
    ref = async_reference[0]
    run, hist, lines = _adaptive_run(3, faults_at=(1, how))
    assert run.recoveries and run.recoveries[0]["lost"] == [run.victim], run.recoveries
    assert any("checkpoint of step 2 abandoned" in s for s in lines), lines
    rec = run.recoveries[0]
    # from live replicas (nothing lost), or from the previous complete checkpoint: the one of step 1
    assert (rec["source"], rec["steps_lost"]) in {("live", 0), ("checkpoint", 1)}, rec
    assert [m["update_count"] for m in hist][-1] == 6
    steps = [c["step"] for c in run.checkpoints]
    assert steps[:2] == [0, 1] and steps[-1] == 3, steps
    for ms, st in ref.final_state.items():
        got = run.final_state[ms]
        assert got["update_count"] == st["update_count"] and got["position"] == st["position"]
        for n in st["params"]:
            assert torch.allclose(got["params"][n], st["params"][n], atol=1e-5, rtol=1e-4), (ms, n)


def _wait_dead(pids: list[int], timeout_s: float = 60.0) -> None:
    """Wait until every process in ``pids`` is gone (or a zombie), at most ``timeout_s``."""
    import time

    def alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/status") as f:
                return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
        except OSError:
            return False

    end = time.monotonic() + timeout_s
    while any(alive(q) for q in pids) and time.monotonic() < end:
        time.sleep(0.05)


@pytest.mark.slow
def test_every_train_replica_lost_in_the_background_write_restores_the_previous_checkpoint(async_reference):
    """Both workers of actor.train (dp=2 on this plan; both also write a replica 0 of some
    model-stage) die in the background write of the checkpoint taken after step 1: no replica of
    actor.train survives, so the run restores the previous complete checkpoint, the one of step 1
    (not the abandoned one of step 2), loses 1 step, re-runs it and ends at the fault-free weights."""
    from nereus.runtime.run.adaptive import AdaptiveRun

    ref = async_reference[0]
    p = WorkerPool(4, timeout_s=15, hang_timeout_s=3).start()
    lines: list[str] = []
    run = AdaptiveRun(SPEC, W, TASK, 4, RLConfig(actor_lr=1e-2, critic_lr=1e-2, timeout_s=15), hang_timeout_s=3,
                      log=lines.append, measure=False, checkpoint_every=1, framework="nereus")
    run.keep_final = True
    armed: list[int] = []

    def arm(k: int) -> None:
        if k != 1:
            return
        d = run.driver
        victims = sorted(d.layouts["actor.train"].workers)
        writers = {w for lay in d.layouts.values() for w in lay.replica(0)}
        assert set(victims) <= writers and d.layouts["actor.train"].dp == 2, (victims, writers)
        run.faults[k] = ("dcp_save", victims[0], "kill")
        d._get([d.workers[w].arm.options(concurrency_group="control").remote("dcp_save", "kill")
                for w in victims[1:]], "arm")
        armed.extend(victims)

    def hook(k: int) -> None:
        arm(k)
        if k == 2 and armed:  # both die inside their background writes; on a loaded machine one
            _wait_dead([p.pids[w] for w in armed])  # can lag: let both go before the boundary looks
    run.before_step = hook
    try:
        hist = run.run(3, p)
    finally:
        p.close()
    assert armed and run.recoveries, lines
    rec = run.recoveries[0]
    assert sorted(rec["lost"]) == armed and rec["source"] == "checkpoint" and rec["steps_lost"] == 1, rec
    assert any("checkpoint of step 2 abandoned" in s for s in lines), lines
    assert any("restored the durable checkpoint of step 1" in s for s in lines), lines
    assert [m["step"] for m in hist] == [0, 1, 1, 2]  # step 1 re-runs with the same samples
    assert [m["update_count"] for m in hist] == [2, 4, 4, 6]
    for ms, st in ref.final_state.items():
        got = run.final_state[ms]
        assert got["update_count"] == st["update_count"] and got["position"] == st["position"]
        for n in st["params"]:
            assert torch.allclose(got["params"][n], st["params"][n], atol=1e-5, rtol=1e-4), (ms, n)
