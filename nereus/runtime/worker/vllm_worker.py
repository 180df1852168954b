"""The worker-side half of ``--rollout vllm``: a generation EMU served by a vLLM engine.

:class:`VllmWorkerMixin` (a base of ``WorkerCore``) keeps, per generation model-stage, the vLLM engine
(``worker/vllm_engine.py``) on TP rank 0 of each replica. The runtime's own engine of that
model-stage stays on every rank as the weight-sync *receiver*: ``WorkerCore.sync_weights`` moves into
it, rank-aligned, only the pieces each rank lacks (``transit/plans.py``), and :meth:`vllm_push` then
hands each rank's shard to the vLLM rank of the same TP index (``worker/vllm_ext.py``): rank ``t``
writes ``rank-<t>.safetensors`` into the replica's hand-off directory (memory-backed ``/dev/shm``)
and says so in the job's TCPStore, and TP rank 0, once every rank's file is there, asks every vLLM rank to copy its own file in
(``collective_rpc``). So each vLLM rank receives its own shard and no process gathers the model.

Measured per push (returned and kept in :attr:`vllm_syncs`): bytes written by this rank, bytes the
engine ranks read, the write, barrier and load seconds.

No orphans (``worker/vllm_reaper.py``): every engine's processes, its config directory, the shared-memory
segments it maps and the replica's hand-off directory are owned by this process's :class:`Reaper`; its
watchdog removes them if this process dies without :meth:`close_vllm` (SIGKILL from ``ray.kill``, SIGTERM),
and ``atexit`` closes the engines on a normal exit.

Starting off the critical path (:meth:`prestart_vllm`): an engine for a replica of a *future* layout can be
started in a background thread of this process while the current engines serve (its start needs only
the model's shapes, the TP degree and the replica index, not the runtime engine); :meth:`build_vllm` of
that replica then adopts it (waiting for the rest of its start, if any) and only pushes the weights.
"""

from __future__ import annotations

import atexit
import os
import threading
import time

import torch

__all__ = ["VllmWorkerMixin", "handoff_dir"]


def handoff_dir(tag: str, model_stage: str, replica: int) -> str:
    """The hand-off directory of one replica's weight pushes (the same path on every rank)."""
    from nereus.runtime.worker.vllm_engine import HANDOFF_ROOT

    return os.path.join(HANDOFF_ROOT, f"nereus-vllm-{tag}-{model_stage}-d{replica}")


class VllmWorkerMixin:
    """vLLM engines of this worker (TP rank 0 of a generation replica holds one)."""

    def _vllm(self) -> dict:
        if not hasattr(self, "_vllm_engines"):
            self._vllm_engines, self._vllm_tags, self.vllm_syncs = {}, {}, []
            self._vllm_pre: dict = {}  # model_stage -> {"key": (tp, replica), "thread", "engine", "error", ...}
        return self._vllm_engines

    def _reaper(self):
        """This process's :class:`~nereus.runtime.worker.vllm_reaper.Reaper` (made on first use, with an
        ``atexit`` hook that closes every engine on a normal exit)."""
        if getattr(self, "_vllm_reaper", None) is None:
            from nereus.runtime.worker.vllm_reaper import Reaper

            self._vllm_reaper = Reaper()
            atexit.register(self.close_all_vllm)
        return self._vllm_reaper

    def _start_engine(self, key: str, spec, tp: int, dtype, replica: int, options: dict | None):
        """Start one vLLM engine (``VllmRollout``) and hand its processes, directories and shared-memory
        segments to the reaper under ``key``."""
        from nereus.runtime.worker import vllm_reaper as vr
        from nereus.runtime.worker.vllm_engine import VllmRollout

        reaper = self._reaper()
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # engines share this machine's cores
        before, segs = {p for p, _t in vr.engine_processes()}, vr.shm_segments()
        try:
            eng = VllmRollout(spec, tp, dtype, seed=replica, options=options, device=self.device)
        except BaseException:  # a failed start: whatever it spawned and mapped goes before the error propagates
            procs = [p for p in vr.engine_processes() if p[0] not in before]
            vr.kill_and_remove([{"pids": procs, "paths": vr.shm_paths(procs)}])
            vr.kill_and_remove([{"pids": [], "paths": vr.orphan_segments(segs)}])  # left by processes already gone
            raise
        procs = [p for p in vr.engine_processes((reaper.watchdog_pid() or -1,)) if p[0] not in before]
        reaper.track(key, procs, [eng.dir] + vr.shm_paths(procs))
        return eng

    def prestart_vllm(self, model_stage: str, spec, tp: int, replica: int, precision: str = "fp32",
                      options: dict | None = None) -> dict:
        """Start, in a background thread, the vLLM engine this worker will hold as TP rank 0 of replica
        ``replica`` (TP ``tp``) of ``model_stage`` in a coming layout; returns at once. The current engines
        keep serving; :meth:`build_vllm` of that replica adopts it. A second call for the same model-stage
        replaces (closes) the first's engine."""
        self._vllm()
        slot = self._vllm_pre.get(model_stage)
        if slot is not None and slot["key"] == (int(tp), int(replica)):
            return {"started": False}  # already starting (or started) for this replica
        self._drop_prestart(model_stage)
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        slot = {"key": (int(tp), int(replica)), "engine": None, "error": None, "t0": time.perf_counter()}

        def run():
            try:
                slot["engine"] = self._start_engine(f"{model_stage}#pre", spec, tp, dtype, replica, options)
            except BaseException as e:  # noqa: BLE001 - reported by build_vllm
                slot["error"] = e
            slot["t1"] = time.perf_counter()

        slot["thread"] = threading.Thread(target=run, name=f"vllm-prestart-{model_stage}", daemon=True)
        slot["thread"].start()
        self._vllm_pre[model_stage] = slot
        return {"started": True}

    def _drop_prestart(self, model_stage: str) -> None:
        slot = self._vllm_pre.pop(model_stage, None)
        if slot is None:
            return
        slot["thread"].join()
        if slot["engine"] is not None:
            slot["engine"].close()
        self._reaper().release(f"{model_stage}#pre")

    def _adopt_prestart(self, model_stage: str, tp: int, replica: int):
        """The engine :meth:`prestart_vllm` started for ``(tp, replica)``, once its start is done, with the
        seconds this call waited for it (None when none was started for that replica). Its ``start_s``
        becomes the whole start from the prestart call (importing vllm, in a thread that shares the
        interpreter with this worker's other calls, included)."""
        slot = self._vllm_pre.get(model_stage)
        if slot is None or slot["key"] != (int(tp), int(replica)):
            self._drop_prestart(model_stage)
            return None
        self._vllm_pre.pop(model_stage)
        t0 = time.perf_counter()
        slot["thread"].join()
        waited = time.perf_counter() - t0
        if slot["error"] is not None:
            self._reaper().release(f"{model_stage}#pre")
            raise slot["error"]
        reaper = self._reaper()
        entry = reaper.owned.pop(f"{model_stage}#pre")
        reaper.track(model_stage, entry["pids"], entry["paths"])
        slot["engine"].start_s = slot["t1"] - slot["t0"]  # the whole start, from the prestart call
        return slot["engine"], waited

    def serves_vllm(self, model_stage: str) -> bool:
        """Whether ``model_stage`` is served by vLLM on this worker's replica (every TP rank says yes)."""
        self._vllm()
        return model_stage in self._vllm_tags

    def build_vllm(self, model_stage: str, tag: str, options: dict | None = None) -> dict:
        """Start the vLLM engine of this worker's replica of ``model_stage`` (its runtime engine must
        be built) and push the runtime engine's weights into it. Collective over the replica's TP group.

        Returns:
            ``{"start_s": engine start seconds (TP rank 0; 0 elsewhere), "kv": kv_report, "push": ...}``.

        Raises:
            ValueError: PP > 1 (vLLM's pipeline parallelism is not driven by this runtime).
        """
        eng = self._vllm()
        if model_stage in eng or model_stage in self._vllm_tags:  # a restart in a new layout: the old one goes
            self.close_vllm(model_stage)
        e = self._engine(model_stage)
        ctx = e.ctx
        if ctx.pp != 1:
            raise ValueError(f"--rollout vllm: model-stage {model_stage} has pp={ctx.pp}; vLLM engines here run "
                             f"TP only (give actor.generate pp=1)")
        self._vllm_tags[model_stage] = tag
        # every rank of the new engine counts its pushes from 0 (a rank that pushed into an engine of an
        # earlier layout had counted on, and rank 0 waited in _files_written for a key rank 1 never set)
        self.__dict__.setdefault("_vllm_seq", {})[model_stage] = 0
        hand = handoff_dir(tag, model_stage, ctx.d)
        self._vllm_dirs = {**getattr(self, "_vllm_dirs", {}), model_stage: hand}
        out = {"start_s": 0.0, "kv": [], "prestarted": False, "waited_s": 0.0}
        if ctx.t == 0:
            # not timed under the model-stage: the start is reported on its own (start_s), not as generation
            pre = self._adopt_prestart(model_stage, ctx.tp, ctx.d)
            if pre is not None:  # started earlier, off the critical path: only the rest of its start waits
                eng[model_stage], out["waited_s"] = pre
                out["prestarted"] = True
            else:
                eng[model_stage] = self._start_engine(model_stage, e.spec, ctx.tp, e.model.dtype, ctx.d, options)
                out["waited_s"] = eng[model_stage].start_s
            out["start_s"] = eng[model_stage].start_s
            out["kv"] = eng[model_stage].kv_report()
            entry = self._reaper().owned[model_stage]
            self._reaper().track(model_stage, entry["pids"], entry["paths"] + [hand])
        else:
            self._reaper().track(model_stage, [], [hand])
        self._drop_prestart(model_stage)  # one for another replica than this worker's is not needed
        out["push"] = self.vllm_push(model_stage)
        return out

    def vllm_push(self, model_stage: str) -> dict:
        """Hand this rank's shard of ``model_stage`` to its vLLM rank (module docstring); collective
        over the replica's TP group. Returns bytes and seconds of this rank's part."""
        from safetensors.torch import save_file

        e = self._engine(model_stage)
        ctx = e.ctx
        d = handoff_dir(self._vllm_tags[model_stage], model_stage, ctx.d)
        os.makedirs(d, exist_ok=True)
        t0 = time.perf_counter()
        shard = {n: w.detach().contiguous().cpu() for n, w in e.model.params.items()}
        save_file(shard, os.path.join(d, f"rank-{ctx.t}.safetensors"))
        t1 = time.perf_counter()
        self._files_written(model_stage, ctx)  # TP rank 0 waits until every rank's file is there
        t2 = time.perf_counter()
        out = {"written": sum(x.numel() * x.element_size() for x in shard.values()), "read": 0,
               "write_s": t1 - t0, "barrier_s": t2 - t1, "load_s": 0.0, "ranks": []}
        if ctx.t == 0:
            ranks = self._vllm()[model_stage].load_shards(d, ctx.tp)
            out["read"] = sum(r["bytes"] for r in ranks)
            out["ranks"] = ranks
            out["load_s"] = time.perf_counter() - t2
        self.vllm_syncs.append(out)
        return out

    def _files_written(self, model_stage: str, ctx) -> None:
        """This rank's file of push ``n`` is written: a TCPStore key; TP rank 0 waits for every rank's
        (the store, not the TP group: while rank 0 starts its engine, minutes on a loaded machine, the
        others wait past any collective's timeout). A rank rewrites its file only in the next sync,
        which the driver starts after this push, rank 0's load included, has returned."""
        from datetime import timedelta

        seqs = self.__dict__.setdefault("_vllm_seq", {})
        seqs[model_stage] = n = seqs.get(model_stage, 0) + 1
        base = f"nereus/vllm/{self._vllm_tags[model_stage]}/{model_stage}/d{ctx.d}/{n}"
        self.store.set(f"{base}/rank-{ctx.t}", "1")
        if ctx.t == 0 and ctx.tp > 1:
            self.store.wait([f"{base}/rank-{r}" for r in range(1, ctx.tp)], timedelta(seconds=max(self.timeout_s, 1800)))

    def vllm_generate(self, model_stage: str, prompts: torch.Tensor, seeds: list[int], max_new_tokens: int,
                      temperature: float, greedy: bool, eos_id: int, pad_id: int):
        """``(responses [B, R], log-probs [B, R])`` from the replica's vLLM engine on TP rank 0; None on
        the other ranks (vLLM's own TP workers do their part)."""
        eng = self._vllm().get(model_stage)
        if eng is None:
            return None
        with self.meter.stage(model_stage):
            return eng.generate(prompts, seeds, max_new_tokens, temperature, greedy, eos_id, pad_id)

    def vllm_prompt_logprobs(self, model_stage: str, tokens: torch.Tensor, prompt_len: int):
        """The engine's log-probs of fixed sequences (``VllmRollout.prompt_logprobs``); None off TP rank 0."""
        eng = self._vllm().get(model_stage)
        return None if eng is None else eng.prompt_logprobs(tokens, prompt_len)

    def vllm_report(self, model_stage: str) -> dict:
        """KV report and weight pushes of this worker's engine of ``model_stage``."""
        eng = self._vllm().get(model_stage)
        return {"kv": eng.kv_report() if eng is not None else [], "start_s": eng.start_s if eng else 0.0,
                "syncs": list(self.vllm_syncs)}

    def close_vllm(self, model_stage: str) -> None:
        """Shut this worker's vLLM engine of ``model_stage`` down (if any) and remove its hand-off directory;
        the model-stage is no longer served by vLLM here (local, no collective)."""
        import shutil

        eng = self._vllm().pop(model_stage, None)
        self._vllm_tags.pop(model_stage, None)
        if eng is not None:
            eng.close()
        d = getattr(self, "_vllm_dirs", {}).pop(model_stage, None)
        if d:
            shutil.rmtree(d, ignore_errors=True)
        if getattr(self, "_vllm_reaper", None) is not None:
            self._vllm_reaper.release(model_stage)  # whatever of the engine's processes and files is left

    def vllm_prestart_status(self, model_stage: str) -> dict:
        """The background start of :meth:`prestart_vllm` for ``model_stage``: ``{"key": (tp, replica) or
        None, "done": whether it ended, "elapsed_s": seconds since the prestart call (the whole start once
        done), "error": its error text or None}``."""
        self._vllm()
        slot = self._vllm_pre.get(model_stage)
        if slot is None:
            return {"key": None, "done": False, "elapsed_s": 0.0, "error": None}
        done = not slot["thread"].is_alive()
        end = slot.get("t1") if done and slot.get("t1") is not None else time.perf_counter()
        return {"key": slot["key"], "done": done, "elapsed_s": end - slot["t0"],
                "error": None if slot["error"] is None else repr(slot["error"])[:300]}

    def drop_vllm_prestart(self, model_stage: str) -> None:
        """Close the engine :meth:`prestart_vllm` started for ``model_stage`` (waiting for its start to end)."""
        self._vllm()
        self._drop_prestart(model_stage)

    def close_all_vllm(self) -> None:
        """Close every vLLM engine of this worker, prestarted ones included (``atexit``; a worker's teardown)."""
        self._vllm()
        for ms in list(self._vllm_pre):
            self._drop_prestart(ms)
        for ms in set(self._vllm_engines) | set(self._vllm_tags):
            self.close_vllm(ms)

    def vllm_processes(self) -> dict:
        """What this worker owns for vLLM (checks): ``{"pid", "watchdog", "owned": {key: {"pids", "paths"}}}``."""
        r = getattr(self, "_vllm_reaper", None)
        return {"pid": os.getpid(), "watchdog": None if r is None else r.watchdog_pid(),
                "owned": {} if r is None else {k: dict(v) for k, v in r.owned.items()}}
