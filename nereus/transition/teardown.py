"""What a Destroy costs: freeing a shard's tensors, and the warm-up of the allocator that frees them.

Source: ours (issue 26: a lone Destroy was priced by the median of earlier Destroys, 1.79x off in
one run). The runtime's Destroy (``runtime/transit/worker_side.py``, ``Transit.run``) drops the
unit's tensors: one ``free`` per tensor, no collective, no copy. Two regimes, from glibc's malloc
(mallopt(3), ``M_MMAP_THRESHOLD`` and ``M_TRIM_THRESHOLD``):

* **warm**: the freed chunks stay in the heap (the process keeps the memory for its next
  allocations); each tensor costs a fixed amount of bookkeeping (Python and c10 deallocation, one
  ``free``) whatever its size. Measured on the benchmark's Ray workers (``small`` preset, one run,
  195 Destroys, medians): a full ``actor.train`` replica (225 tensors, 57 MB) 0.45 ms, a TP 2 half
  of it (225 tensors, 28.5 MB) 0.54 ms, a PP 2 half of ``critic.train`` (117 tensors, 28.4 MB)
  0.29 ms, an inference copy (75-76 tensors, 19 MB) 0.19-0.20 ms (docs/live-transition.md): the
  seconds follow the tensors, not the bytes. In one process without Ray, 225 tensors of that model freed into a heap that is
  never trimmed take 0.2-0.3 ms (about 1.1 µs a tensor).
* **cold**: the chunks go back to the kernel (``munmap`` of a chunk at or above the mmap
  threshold, or a trim of the heap's top), which costs per page: the same 225 tensors, their
  memory returned on every free, take 4-6 ms (about 20 µs a tensor) in the same process. glibc
  raises the mmap threshold to the size of each mmapped chunk it frees, so a fresh process (a
  restarted worker) starts cold and warms up over its first Destroys: the earlier run's Destroys
  went from 0.7-2.1 ms in the first repetitions after the faithful restarts to 0.2-0.3 ms.

So a Destroy is priced ``teardown_s + teardown_tensor_s · n`` (``cost.duration``), ``n`` the most
tensors one of its workers frees (:func:`freed_tensors`; ``Primitive.freed_tensors``, set by
:func:`with_freed_tensors`). ``calibrate.fit_teardown`` fits the two constants from measured
Destroys and discounts a warm-up still under way (:func:`trend_slope`).

Pure: no runtime import.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from nereus.cost.shapes import layers_of_rank
from nereus.spec.job import JobSpec
from nereus.spec.model import ModelSpec
from nereus.transition.emu import EMU, stage_of
from nereus.transition.primitives import Primitive

__all__ = ["tensors_on_rank", "state_kinds", "freed_tensors", "with_freed_tensors", "trend_slope"]

#: bytes per parameter of one optimizer tensor: AdamW's ``exp_avg``, ``exp_avg_sq`` and the master
#: weights are fp32 (Loshchilov & Hutter 2019; Megatron's and DeepSpeed's mixed precision)
OPTIMIZER_TENSOR_BYTES = 4


def tensors_on_rank(model: ModelSpec, pp: int, p: int) -> int:
    """Parameter tensors pipeline rank ``p`` of ``pp`` holds (of one state kind), >= 1.

    Hugging Face's Llama/Qwen state-dict layout, which the runtime's ``param_shapes`` follows: per
    decoder layer 9 (two RMSNorm weights, q/k/v/o projections, gate/up/down projections), plus 2
    with ``qk_norm``, 3 with ``qkv_bias``, 1 with ``o_bias``; the layers of ``p`` split as
    ``cost.shapes.layers_of_rank``; rank 0 holds the input embedding (the last rank a copy too when
    the embedding is tied and ``pp > 1``); the last rank holds the final norm and the head
    (``score.weight`` and ``score.bias`` for a value head, ``lm_head.weight`` unless tied). The
    ``small`` preset at ``pp = 1``: ``8·9 + 1 + 1 + 1 = 75``. TP does not change the count (each
    tensor is cut, not split into several).

    Raises:
        ValueError: ``pp`` or ``p`` out of range (``layers_of_rank``).
    """
    per_layer = 9 + 2 * bool(model.qk_norm) + 3 * bool(model.qkv_bias) + bool(model.o_bias)
    n = per_layer * len(layers_of_rank(model.num_layers, pp, p))
    lm = model.head == "lm"
    tied_copy = model.tie_word_embeddings and lm and pp > 1
    n += (p == 0) + (p == pp - 1 and tied_copy)
    if p == pp - 1:
        n += 1 + (2 if not lm else (0 if model.tie_word_embeddings else 1))
    return n


def state_kinds(job: JobSpec, model_stage: str) -> int:
    """Tensors per parameter of a model-stage's state: 1 (weights) for generate and infer; for
    train, 1 plus ``workload.optimizer_bytes / 4`` (fp32 optimizer tensors: exp_avg and exp_avg_sq,
    and the master weights when the weights are not fp32: 12 B -> 4 kinds, 8 B -> 3)."""
    if stage_of(model_stage) != "train":
        return 1
    return 1 + max(0, round(job.workload.optimizer_bytes / OPTIMIZER_TENSOR_BYTES))


def freed_tensors(emu: EMU, model: ModelSpec, kinds: int) -> int:
    """The most tensors one GPU frees when ``emu`` is destroyed: ``kinds`` times the largest
    :func:`tensors_on_rank` over its pipeline ranks. A ZeRO group (``z > 1``) is counted as its
    unsharded shards (a bound: the runtime's flat slots are fewer tensors)."""
    return kinds * max(tensors_on_rank(model, emu.pp, p) for p in range(emu.pp))


def with_freed_tensors(nodes, current, model: ModelSpec, kinds: int) -> tuple[Primitive, ...]:
    """``nodes`` (one model-stage's primitives) with each Destroy's ``freed_tensors`` set
    (:func:`freed_tensors`); the EMU it consumes is looked up among ``current`` and every node's
    products; other primitives unchanged."""
    emus = {e.uid: e for e in current}
    for n in nodes:
        emus.update({e.uid: e for e in n.produces})
    out = []
    for n in nodes:
        if n.kind == "destroy" and n.consumes and n.consumes[0] in emus:
            k = freed_tensors(emus[n.consumes[0]], model, kinds)
            out.append(replace(n, freed_tensors=k) if k != n.freed_tensors else n)
        else:
            out.append(n)
    return tuple(out)


def trend_slope(ys: list[float]) -> float:
    """Theil–Sen slope (Sen, JASA 1968) of ``ys`` against their index 0, 1, ...: the median of
    ``(ys[j] − ys[i]) / (j − i)`` over ``i < j``; 0 for fewer than 2 values."""
    s = [(ys[j] - ys[i]) / (j - i) for i in range(len(ys)) for j in range(i + 1, len(ys))]
    return statistics.median(s) if s else 0.0
