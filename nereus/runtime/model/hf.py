"""Hugging Face checkpoints: each worker reads only its own shard; the trained model is written back.

Loading (:func:`read_shards`): the tensor names of a Llama/Qwen2/Qwen3 ``*.safetensors`` checkpoint are
the runtime's logical parameter names (``runtime/model/sharding.py``). A worker opens the files lazily
(``safetensors.safe_open``) and reads, for every parameter of its PP rank, only the rows or columns
of its TP region (``shards.region``: ``get_slice(name)[lo:hi]`` or ``[:, lo:hi]``), so no process
ever holds the full model. The index file ``model.safetensors.index.json`` maps names to files when
the checkpoint is split; without one, every ``*.safetensors`` file in the directory is scanned.
Tensors are cast to the engine's dtype (a bf16 checkpoint becomes fp32 master weights). A tied
embedding's output layer is ``model.embed_tokens.weight``; a value head (critic, reward model) reads
``score.weight``/``score.bias`` when the checkpoint has them (a ``*ForTokenClassification`` model with
one label, as :func:`save_stage` writes) and otherwise starts from ``N(0, 0.02)`` and zero bias drawn
from the seed (``layout.init_param``, as a random-initialized model's head; the backbone still comes
from the checkpoint, as verl initialises its critic).

Saving (:func:`save_stage`): collective over one replica's TP group of each PP rank: the stage's
shards are all-gathered within the TP group, and TP rank 0 of PP rank ``p`` writes
``model-0000{p+1}-of-0000{pp}.safetensors``; PP rank 0 also writes the index, ``config.json``
(``*ForCausalLM``, or ``*ForTokenClassification`` with ``num_labels=1`` for a value head) and copies
the tokenizer files of the source checkpoint. So one process holds at most one full pipeline stage.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from nereus.runtime.model.sharding import init_param, names_of_stage, param_shapes, tied_copy
from nereus.runtime.transit.plans import region
from nereus.spec.model import ModelSpec

__all__ = ["checkpoint_index", "read_shards", "save_stage", "TOKENIZER_FILES"]

#: tokenizer files copied from the source checkpoint on save
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja",
                   "added_tokens.json")

_ARCH = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}


def checkpoint_index(directory: str | os.PathLike) -> dict[str, str]:
    """Tensor name → file path of a Hugging Face checkpoint directory.

    Raises:
        ValueError: no ``*.safetensors`` file, or an index naming a missing file.
    """
    d = Path(directory)
    idx = d / "model.safetensors.index.json"
    if idx.is_file():
        wm = json.loads(idx.read_text()).get("weight_map", {})
        out = {k: str(d / v) for k, v in wm.items()}
        missing = sorted({v for v in out.values() if not os.path.isfile(v)})
        if missing:
            raise ValueError(f"checkpoint {str(d)!r}: index names missing file(s) {missing[:3]}")
        return out
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ValueError(f"checkpoint {str(d)!r} holds no *.safetensors file (pytorch_model.bin is not read)")
    from safetensors import safe_open

    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                out[k] = str(f)
    return out


def read_shards(spec: ModelSpec, pp: int, p: int, tp: int, t: int, dtype: torch.dtype = torch.float32,
                device: str = "cpu", seed: int = 0, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """This rank's shards of ``spec.checkpoint``: name → tensor in the layout's shard shape.

    Args:
        pp, p, tp, t: the rank's PP and TP position.
        seed: value-head initialisation when the checkpoint has none.
        names: a subset of the rank's parameters (default: all of PP rank ``p``).

    Returns:
        name → tensor of shape ``layout.shard``'s (vocab rows padded with zeros to ``ceil(V/tp)``).

    Raises:
        ValueError: ``spec.checkpoint`` unset, a tensor missing from the checkpoint or of another shape.
    """
    if not spec.checkpoint:
        raise ValueError(f"model {spec.name!r} has no checkpoint directory")
    from safetensors import safe_open

    where = checkpoint_index(spec.checkpoint)
    shapes = param_shapes(spec)
    want = names if names is not None else names_of_stage(spec, pp, p)
    out: dict[str, torch.Tensor] = {}
    handles: dict[str, object] = {}
    try:
        for n in want:
            key = n
            if n == "lm_head.weight" and n not in where and spec.tie_word_embeddings:
                key = "model.embed_tokens.weight"
            if key not in where:
                if n.startswith("score."):
                    out[n] = init_param(spec, seed, n, dtype=dtype).to(device)
                    continue
                raise ValueError(f"checkpoint {spec.checkpoint!r} lacks tensor {key!r} that model {spec.name!r} "
                                 f"needs (config and weights disagree)")
            f = where[key]
            if f not in handles:
                handles[f] = safe_open(f, framework="pt")
            sl = handles[f].get_slice(key)
            full_shape = tuple(sl.get_shape())
            if full_shape != tuple(shapes[n][0]):
                raise ValueError(f"checkpoint tensor {key!r} has shape {full_shape}, config says "
                                 f"{tuple(shapes[n][0])}")
            r = region(spec, n, tp, t)
            if r.dim is None:
                x = sl[:]
            elif r.dim == 0:
                x = sl[r.lo:r.hi]
            else:
                x = sl[:, r.lo:r.hi]
            x = x.to(dtype)
            if r.dim is not None and r.hi - r.lo < r.length:  # vocab padding
                pad = list(x.shape)
                pad[r.dim] = r.length - (r.hi - r.lo)
                x = torch.cat([x, torch.zeros(pad, dtype=dtype)], r.dim)
            out[n] = x.contiguous().to(device)
    finally:
        handles.clear()
    return out


def hf_config(spec: ModelSpec, source: dict | None = None) -> dict:
    """The ``config.json`` of ``spec``: the source checkpoint's (token ids, dtype, ...) with the shape
    fields of ``spec`` and the architecture of its head."""
    cfg = dict(source or {})
    cfg.update(spec.to_hf_config())
    cfg.pop("rope_parameters", None) if "rope_scaling" in cfg else None
    fam = _ARCH.get(cfg["model_type"], "Llama")
    if spec.head == "value":
        cfg["architectures"] = [f"{fam}ForTokenClassification"]
        cfg["num_labels"] = 1
        cfg["id2label"] = {"0": "LABEL_0"}
        cfg["label2id"] = {"LABEL_0": 0}
    else:
        cfg["architectures"] = [f"{fam}ForCausalLM"]
    cfg["torch_dtype"] = "float32"
    cfg["dtype"] = "float32"
    return cfg


def save_stage(engine, directory: str | os.PathLike) -> int:
    """Write ``engine``'s PP stage into a Hugging Face directory (module docstring). Collective over
    the engine's TP group; call it on every worker of one DP replica.

    Returns:
        bytes this worker wrote (0 on TP ranks other than 0).
    """
    from safetensors.torch import save_file

    spec, ctx = engine.spec, engine.ctx
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    names = engine.model.names
    # a bf16 run saves its fp32 master weights (the config says float32)
    flat = engine._full_stage(engine.master or {n: w.detach() for n, w in engine.model.params.items()})
    if ctx.t != 0:
        return 0
    shapes = param_shapes(spec)
    tensors, off = {}, 0
    for n in names:
        k = int(torch.Size(shapes[n][0]).numel())
        if not (n == "model.embed_tokens.weight" and ctx.p > 0 and tied_copy(spec, ctx.pp)):
            tensors[n] = flat[off:off + k].view(shapes[n][0]).clone()
        off += k
    fname = f"model-{ctx.p + 1:05d}-of-{ctx.pp:05d}.safetensors"
    save_file(tensors, str(d / fname), metadata={"format": "pt"})
    written = sum(x.numel() * x.element_size() for x in tensors.values())
    if ctx.p == 0:
        wm = {}
        for q in range(ctx.pp):
            for n in names_of_stage(spec, ctx.pp, q):
                if n == "model.embed_tokens.weight" and q > 0:
                    continue
                wm[n] = f"model-{q + 1:05d}-of-{ctx.pp:05d}.safetensors"
        total = sum(int(torch.Size(shapes[n][0]).numel()) * 4 for n in wm)
        (d / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": wm}, indent=1))
        src = {}
        if spec.checkpoint and (Path(spec.checkpoint) / "config.json").is_file():
            src = json.loads((Path(spec.checkpoint) / "config.json").read_text())
        (d / "config.json").write_text(json.dumps(hf_config(spec, src), indent=1))
        if spec.checkpoint:
            for f in TOKENIZER_FILES:
                s = Path(spec.checkpoint) / f
                if s.is_file() and s.resolve() != (d / f).resolve():
                    shutil.copyfile(s, d / f)
    return written
