"""Efficiency per op class: the shortfall of achieved rates against peak (DESIGN.md §4.2-4.3).

Time of an op = work / (peak rate · efficiency of its op class). Op classes are ``gemm``,
``attention``, ``memory_bound`` and one per (collective, link), e.g. ``allreduce@nvlink``,
``allreduce@ib``, ``p2p@ib``, ``allgather@nvlink``, ``broadcast@ib``. One efficiency per class is
shared by every plan that uses the class; unseen classes start at a conservative default.

GEMMs also lose efficiency when small; the class efficiency multiplies a fixed size curve
``size / (size + half)`` with ``half`` = the device's ``gemm_half_flops`` (1 GFLOP per call for
data-centre GPUs: the form suggested in cost-model.md §3 after Calculon's H100 preset, which gives
0.6 at 1 GFLOP and 0.9 at 16 GFLOP), so calibration moves one scalar per class.

Lookup order of :meth:`EfficiencyTable.get`: a calibrated value of the table, else the GPU's own
default (:attr:`nereus.spec.hardware.GPUSpec.default_efficiency`: per-generation fractions from
published kernel microbenchmarks, sources in :data:`nereus.spec.hardware.GPU_DEFAULT_EFFICIENCY`), else
the GPU-independent defaults below.

Attention also loses efficiency at short sequences: FlashAttention's per-tile overheads and the
partly masked diagonal tiles of causal attention weigh more when a sequence has few tiles. The class
efficiency multiplies ``s / (s + ATTN_SEQ_HALF)`` (:func:`attention_seq_factor`, ``s`` = keys each
query attends), with ``ATTN_SEQ_HALF = 256`` tokens read off FlashAttention-3 (Shah et al. 2024,
arXiv:2407.08608) Fig. 5-6, FlashAttention-2 on H100, head dim 128, at a fixed 16k tokens per batch:
forward with causal mask 191, 260, 298, 319, 333, 335 TFLOP/s and backward 214, 260, 291, 310, 318,
322 TFLOP/s at 512, 1k, 2k, 4k, 8k, 16k tokens, i.e. 0.57-0.66 of the 16k rate at 512 tokens,
0.78-0.81 at 1k, 0.89-0.90 at 2k, 0.95-0.96 at 4k; the curve gives 0.67, 0.80, 0.89, 0.94, 0.97,
0.98. The FlashAttention-2 paper's A100 figures (Dao 2023, Fig. 4-6) rise with sequence length the
same way.

Head dimension: at 64 the same kernel reaches 324 of the 370 TFLOP/s it reaches at 128 (FlashAttention-3
Fig. 5, FlashAttention-2 on H100, forward without causal mask, 16k tokens): smaller tiles per head,
less work per load. :func:`attention_head_factor` is ``324/370`` at ``d <= 64``, 1 at ``d >= 128``,
linear between (256 is taken as 128: the figures give no like-for-like point).

Attention kernels other than FlashAttention-2 (``WorkloadSpec.attention_kernel``; the class
efficiency above is FlashAttention-2's): *FlashAttention in Triton* takes :data:`TRITON_FA_SLOWDOWN`
= (1.4, 2.0) times FlashAttention-2's time in the forward and backward pass: FlashAttention-2 (Dao
2023, arXiv:2307.08691, §4.1, A100 80GB, sequence 512-16k, head dim 64 and 128, with and without
causal mask) "is around 1.3-1.5x faster than FlashAttention in Triton in the forward pass and
around 2x faster in the backward pass" (1.4 the middle of 1.3-1.5). *Unfused* attention (the
scores materialised in HBM) has no efficiency of its own: :mod:`nereus.cost.latency` charges its
batched GEMMs on the ``gemm`` class and its softmax (and dropout) as HBM traffic.

FP8 GEMMs (a workload with ``gemm_precision="fp8"``, Transformer Engine style: the linear layers in
FP8, attention and everything else in bf16) are their own op class ``gemm_fp8`` on the GPU's
``peak_flops_fp8``; unseen GPU-independent default 0.5.

GPU-independent defaults (conservative, cost-model.md §5 "achievable fractions"): GEMM 0.6, attention 0.45,
HBM-bound 0.7, NVLink/xGMI collectives 0.6 (Calculon NVLink 0.6; 8xA100 sendrecv 65% of peak),
NIC collectives 0.75 (Calculon IB 0.9, lowered for contention), host-device copies over PCIe 0.8
(pinned ``cudaMemcpyAsync`` reaches 25-26 GB/s of Gen4's 32, as CUDA's ``bandwidthTest`` sample
reports), anything unseen 0.5.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["EfficiencyTable", "DEFAULT_EFFICIENCY", "GEMM_SIZE_HALF", "ATTN_SEQ_HALF", "attention_seq_factor",
           "default_efficiency", "attention_head_factor", "ATTN_HEAD64", "TRITON_FA_SLOWDOWN"]

#: Default FLOPs per GEMM call at which the size curve reaches half of the class efficiency
#: (devices override it with ``GPUSpec.gemm_half_flops``).
GEMM_SIZE_HALF = 1e9

#: Keys per query at which attention reaches half of its class efficiency (FlashAttention-3 paper
#: Fig. 5-6, FlashAttention-2 on H100; see the module docstring).
ATTN_SEQ_HALF = 256.0

DEFAULT_EFFICIENCY: dict[str, float] = {
    "gemm": 0.6,
    "gemm_fp8": 0.5,
    "attention": 0.45,
    "memory_bound": 0.7,
    # engine overheads (nereus.cost.engine_terms): fixed latencies, 1 = the figure as configured
    "decode_overhead": 1.0,
    "engine": 1.0,
    "launch": 1.0,
    "framework": 1.0,
}
_LINK_DEFAULT = {"nvlink": 0.6, "xgmi": 0.6, "ib": 0.75, "slingshot": 0.75, "pcie": 0.8}
UNSEEN_DEFAULT = 0.5


def attention_seq_factor(seq_len):
    """``s / (s + ATTN_SEQ_HALF)``: the share of its long-sequence efficiency attention reaches when
    each query attends ``s`` keys (elementwise; 1 for no attention, ``s <= 0``)."""
    s = np.asarray(seq_len, dtype=float)
    out = np.where(s > 0, s / np.maximum(s + ATTN_SEQ_HALF, 1e-9), 1.0)
    return float(out) if out.ndim == 0 else out


#: Compute slowed while communication runs beside it: overlapped execution takes this fraction more
#: time for the compute it overlaps (Lee et al., "Characterizing Compute-Communication Overlap in
#: GPU-Accelerated Distributed Deep Learning", arXiv:2507.03114, 2025: average computational slowdown
#: 18.9%, at most 40.0%, over GPT and LLaMA layers on A100, H100, MI250 and MI210: NCCL kernels take
#: SMs and HBM bandwidth from the GEMMs they overlap). Charged as ``s · min(T_comm, T_window)``.
OVERLAP_COMPUTE_SLOWDOWN = 0.189

#: FlashAttention in Triton: (forward, backward) time relative to FlashAttention-2 (FlashAttention-2
#: paper §4.1: FA2 "around 1.3-1.5x faster ... in the forward pass and around 2x faster in the backward pass")
TRITON_FA_SLOWDOWN = (1.4, 2.0)

#: attention at head dim 64 relative to 128 (FlashAttention-3 paper Fig. 5, FA2 on H100: 324 / 370 TFLOP/s)
ATTN_HEAD64 = 324.0 / 370.0


def attention_head_factor(head_dim: int) -> float:
    """Share of its head-dim-128 efficiency attention reaches at ``head_dim``: ``ATTN_HEAD64`` at 64
    or less, 1 at 128 or more, linear between."""
    d = float(head_dim)
    if d >= 128:
        return 1.0
    if d <= 64:
        return ATTN_HEAD64
    return ATTN_HEAD64 + (1.0 - ATTN_HEAD64) * (d - 64.0) / 64.0


def default_efficiency(op_class: str, gpu=None) -> float:
    """The default of ``op_class``: ``gpu``'s own (:meth:`GPUSpec.efficiency_default`) when it gives
    one, else the GPU-independent default (by class, then by the link after ``@``)."""
    if gpu is not None:
        v = gpu.efficiency_default(op_class)
        if v is not None:
            return v
    if op_class in DEFAULT_EFFICIENCY:
        return DEFAULT_EFFICIENCY[op_class]
    _, _, link = op_class.partition("@")
    return _LINK_DEFAULT.get(link, UNSEEN_DEFAULT)


@dataclass
class EfficiencyTable:
    """Mutable table ``op class → efficiency in (0, 1.5]``; the planner always reads the current one.

    The table holds calibrated values only; an op class without one falls back to the default of the
    GPU it runs on (:func:`default_efficiency`). ``get(op_class, gpu)`` is how the cost model asks.

    ``update`` is the calibration step: given the time measured for a class and the time the model
    predicted with the current efficiency, it moves the efficiency towards
    ``eff · predicted / measured`` (an exponential moving average with weight ``alpha``). An
    uncalibrated class starts from the default the prediction used, ``get(op_class, gpu)``, so the
    caller passes the GPU the measurement ran on.
    """

    values: dict = field(default_factory=dict)
    alpha: float = 0.5
    updates: dict = field(default_factory=dict)

    def get(self, op_class: str, gpu=None) -> float:
        """Efficiency of ``op_class`` (fraction of peak): calibrated, else ``gpu``'s default, else the
        GPU-independent default."""
        if op_class in self.values:
            return self.values[op_class]
        return default_efficiency(op_class, gpu)

    def set(self, op_class: str, eff: float) -> None:
        if not 0 < eff <= 1.5:
            raise ValueError(f"efficiency of {op_class!r} must be in (0, 1.5], got {eff!r}")
        self.values[op_class] = float(eff)

    def update(self, op_class: str, measured_s: float, predicted_s: float, gpu=None) -> float:
        """Calibrate ``op_class`` from one measurement (on ``gpu``, when known); returns the new
        efficiency.

        Raises:
            ValueError: non-positive times.
        """
        if measured_s <= 0 or predicted_s <= 0:
            raise ValueError(f"calibration of {op_class!r} needs positive times, got measured="
                             f"{measured_s!r}, predicted={predicted_s!r}")
        old = self.get(op_class, gpu)
        target = old * predicted_s / measured_s
        new = min(max((1 - self.alpha) * old + self.alpha * target, 1e-3), 1.5)
        self.values[op_class] = new
        self.updates[op_class] = self.updates.get(op_class, 0) + 1
        return new

    def copy(self) -> EfficiencyTable:
        return EfficiencyTable(values=dict(self.values), alpha=self.alpha, updates=dict(self.updates))

    def to_dict(self) -> dict:
        return {"values": dict(self.values), "alpha": self.alpha}

    @classmethod
    def from_dict(cls, d: dict) -> EfficiencyTable:
        t = cls(alpha=float(d.get("alpha", 0.5)))
        for k, v in d.get("values", {}).items():
            t.set(k, float(v))
        return t
