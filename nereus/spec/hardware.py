"""GPU presets and clusters of N nodes x G GPUs with their links.

All bandwidths are per direction, per GPU, in bytes/s; FLOP/s are dense bf16 tensor-core rates (and
dense FP8 in ``peak_flops_fp8`` where the GPU has FP8 tensor cores);
``memory_bytes`` is what the device reports (``nvidia-smi``), which is what allocations compete for.
Each preset carries its sources (vendor datasheets, ``nvidia-smi``) in ``source``.

GPU ids in a cluster are global integers ``0 .. N·G-1``; GPU ``i`` sits on node ``i // G``. A *pool*
(``P_gpu``) is any subset of these ids.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from nereus.spec.gpu_bounds import check_plausible

__all__ = ["GPUSpec", "ClusterSpec", "GPU_PRESETS", "GPU_DEFAULT_EFFICIENCY", "GEMM_SHAPE_DERATE", "get_gpu"]

GIB = 1024**3


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator (one GCD for MI250X).

    Attributes:
        name: preset name.
        peak_flops: dense bf16 FLOP/s.
        memory_bytes: device capacity as reported by the driver, bytes.
        hbm_bandwidth: bytes/s.
        scaleup_bandwidth: per-direction bytes/s per GPU inside a node (NVLink / Infinity Fabric).
        scaleout_bandwidth: per-direction bytes/s per GPU across nodes (one NIC per GPU).
        scaleup_link, scaleout_link: link names used in op classes (``allreduce@nvlink``...).
        scaleup_latency, scaleout_latency: per-message latency α in seconds.
        host_bandwidth: per-direction bytes/s between this GPU and host memory (PCIe), used for
            offload and reload of idle model-stages; pinned-memory copies reach about 80% of it
            (op class ``offload@pcie``).
        host_memory_bandwidth: this GPU's share of its node's host DRAM bandwidth, bytes/s (the
            node's theoretical DRAM bandwidth over its GPUs), used for the CPU optimizer step of
            ``offload="cpu_adam"`` (op class ``cpu_adam@host``).
        gemm_half_flops: FLOPs per GEMM call at which GEMM efficiency reaches half of its class
            value (the size curve of :mod:`nereus.cost.efficiency`; 1 GFLOP for data-centre GPUs
            after Calculon's H100 preset).
        peak_flops_fp8: dense FP8 tensor-core FLOP/s; 0 when the GPU has no FP8 tensor cores (a job
            whose workload asks for FP8 GEMMs is then refused by the cost model).
        default_efficiency: op class → achieved fraction of peak for this GPU generation, consulted by
            :meth:`nereus.cost.efficiency.EfficiencyTable.get` before the GPU-independent defaults
            and after any calibrated value. Given as a mapping; stored as sorted ``(class, fraction)``
            pairs so the spec stays hashable. Each preset's numbers and their sources are in
            :data:`GPU_DEFAULT_EFFICIENCY`.
        source: where the figures come from.
    """

    name: str
    peak_flops: float
    memory_bytes: int
    hbm_bandwidth: float
    scaleup_bandwidth: float
    scaleout_bandwidth: float
    scaleup_link: str = "nvlink"
    scaleout_link: str = "ib"
    scaleup_latency: float = 5e-6
    scaleout_latency: float = 10e-6
    gemm_half_flops: float = 1e9
    host_bandwidth: float = 32e9
    host_memory_bandwidth: float = 25.6e9
    peak_flops_fp8: float = 0.0
    default_efficiency: tuple = ()
    source: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "default_efficiency", _efficiency_pairs(self.default_efficiency))
        v = self.peak_flops_fp8
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
            raise ValueError(f"GPU field 'peak_flops_fp8' must be a number >= 0 (0: no FP8 tensor cores), got {v!r}")
        for f in ("peak_flops", "memory_bytes", "hbm_bandwidth", "scaleup_bandwidth",
                  "scaleout_bandwidth", "gemm_half_flops", "scaleup_latency", "scaleout_latency",
                  "host_bandwidth", "host_memory_bandwidth"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"GPU field {f!r} must be a number, got {v!r}")
        for f in ("peak_flops", "memory_bytes", "hbm_bandwidth", "scaleup_bandwidth",
                  "scaleout_bandwidth", "host_bandwidth", "host_memory_bandwidth"):
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"GPU field {f!r} must be > 0, got {v!r}")
        if not self.gemm_half_flops > 0:
            raise ValueError(f"GPU field 'gemm_half_flops' must be > 0, got {self.gemm_half_flops!r}")
        for f in ("scaleup_latency", "scaleout_latency"):
            if getattr(self, f) < 0:
                raise ValueError(f"GPU field {f!r} must be >= 0, got {getattr(self, f)!r}")

    def efficiency_default(self, op_class: str) -> float | None:
        """This GPU's default efficiency of ``op_class`` (fraction of peak), or None when the preset
        gives none (the GPU-independent default of :mod:`nereus.cost.efficiency` applies)."""
        for k, v in self.default_efficiency:
            if k == op_class:
                return v
        return None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["default_efficiency"] = dict(self.default_efficiency)
        return d

    @classmethod
    def from_dict(cls, d) -> GPUSpec:
        """A custom GPU from a mapping with at least :data:`GPU_REQUIRED` (``docs/files.md``).

        Raises:
            ValueError: not a mapping, a missing or unknown field, or a value of the wrong type.
        """
        if not isinstance(d, dict):
            raise ValueError(f"cluster field 'gpu' must be a preset name ({', '.join(sorted(GPU_PRESETS))}) or "
                             f"a mapping of GPU fields, got {d!r}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(str(k) for k in set(d) - known)
        if unknown:
            raise ValueError(f"unknown GPU field(s) {unknown}; valid: {sorted(known)}")
        missing = [k for k in GPU_REQUIRED if k not in d]
        if missing:
            raise ValueError(f"custom GPU {d.get('name', '?')!r} is missing field(s) {missing}; give a preset "
                             f"name ({', '.join(sorted(GPU_PRESETS))}) or all of {list(GPU_REQUIRED)}")
        for k, v in d.items():
            if k in ("name", "scaleup_link", "scaleout_link", "source"):
                if not isinstance(v, str):
                    raise ValueError(f"GPU field {k!r} must be a string, got {v!r}")
            elif k == "default_efficiency":
                continue  # checked by _efficiency_pairs at construction
            elif isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"GPU field {k!r} must be a number, got {v!r}")
        if d["memory_bytes"] != int(d["memory_bytes"]):
            raise ValueError(f"GPU field 'memory_bytes' must be a whole number of bytes, got {d['memory_bytes']!r}")
        check_plausible(d)  # a figure in another unit (80 for 80 GiB) is refused by name
        return cls(**(dict(d) | {"memory_bytes": int(d["memory_bytes"])}))


def _efficiency_pairs(d) -> tuple:
    """``default_efficiency`` as sorted ``(op class, fraction)`` pairs.

    Raises:
        ValueError: not a mapping (or pairs), a class that is not a string, or a fraction outside (0, 1.5].
    """
    items = d.items() if isinstance(d, dict) else d
    try:
        pairs = [(k, v) for k, v in items]
    except (TypeError, ValueError) as e:
        raise ValueError(f"GPU field 'default_efficiency' must map op class -> fraction of peak, got {d!r}") from e
    for k, v in pairs:
        if not isinstance(k, str):
            raise ValueError(f"GPU field 'default_efficiency' has a non-string op class {k!r}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1.5:
            raise ValueError(f"GPU field 'default_efficiency'[{k!r}] must be a fraction of peak in (0, 1.5], got {v!r}")
    return tuple(sorted((k, float(v)) for k, v in pairs))


#: fields a custom GPU must give (the others have defaults)
GPU_REQUIRED = ("name", "peak_flops", "memory_bytes", "hbm_bandwidth", "scaleup_bandwidth", "scaleout_bandwidth")

#: GEMM efficiency of training shapes relative to the best-shape ceiling (MAMF, below): 0.75 = the
#: GPU-independent GEMM default 0.6 (cost-model.md §5) over H100's MAMF fraction 0.801. It keeps H100
#: at the old default and gives every other GPU the measured ratio of its ceiling to H100's. Not
#: fitted to the validation measurements.
GEMM_SHAPE_DERATE = 0.75

#: Per-GPU default efficiencies (fraction of the dense peak) from independent kernel microbenchmarks:
#:
#: * ``gemm``: ``GEMM_SHAPE_DERATE`` x the maximum achievable matmul FLOPS (MAMF, bf16, best shape of a
#:   brute-force search) over the datasheet peak, from Stas Bekman's ml-engineering,
#:   ``compute/accelerator/README.md``, table "Maximum Achievable Matmul FLOPS comparison table":
#:   A100 SXM 267.9 / 312 = 85.9%, H100 SXM 792.1 / 989 = 80.1%, MI250X (1 GCD) 147.0 / 191.5 = 76.7%.
#:   H200 takes H100's (same SM and clocks; the same project's H200 figure, 794.5 / 989 = 80.3%, agrees).
#: * ``gemm_fp8``: the same derate x the FP8 MAMF of H200, 1453.4 / 1979 = 73.4% (ml-engineering, its
#:   H200-to-B200 upgrade guide, "MAMF" table "FP8"); H100 has the same FP8 tensor cores.
#: * ``attention``: FlashAttention-2, forward + backward, head dim 128, at long sequences (the
#:   sequence-length curve of :func:`nereus.cost.efficiency.attention_seq_factor` is applied on top):
#:   H100: 0.33, from FlashAttention-3 (Shah et al. 2024, arXiv:2407.08608) Fig. 5 and 6, FA2 on H100
#:   SXM5 at 16k tokens: forward with causal mask 335 TFLOP/s, backward 322 TFLOP/s, of 989;
#:   A100: 0.55, from FlashAttention-2 (Dao 2023, arXiv:2307.08691), abstract and §4.1: 50-73% of the
#:   A100's peak, the backward pass (2.5 of the 3.5 forward-equivalents of attention in training)
#:   at the low end of that range.
#: MI250X has no FlashAttention-2 figure in these sources: its attention uses the GPU-independent default.
GPU_DEFAULT_EFFICIENCY: dict[str, dict[str, float]] = {
    "h100": {"gemm": round(GEMM_SHAPE_DERATE * 792.1 / 989.4, 3), "gemm_fp8": round(GEMM_SHAPE_DERATE * 1453.4 / 1979, 3),
             "attention": 0.33},
    "a100": {"gemm": round(GEMM_SHAPE_DERATE * 267.9 / 312, 3), "attention": 0.55},
    "mi250x": {"gemm": round(GEMM_SHAPE_DERATE * 147.0 / 191.5, 3)},
}
GPU_DEFAULT_EFFICIENCY["h200"] = dict(GPU_DEFAULT_EFFICIENCY["h100"])

GPU_PRESETS: dict[str, GPUSpec] = {
    "h100": GPUSpec(
        name="h100", peak_flops=989.4e12, memory_bytes=81559 * 1024**2, hbm_bandwidth=3.35e12,
        scaleup_bandwidth=450e9, scaleout_bandwidth=50e9, host_bandwidth=64e9, host_memory_bandwidth=76.8e9,
        peak_flops_fp8=1979e12, default_efficiency=GPU_DEFAULT_EFFICIENCY["h100"],
        source="NVIDIA H100 SXM5 datasheet: 989.4 TFLOP/s dense bf16, 1,979 TFLOP/s dense FP8, 3.35 TB/s HBM3, NVLink4 900 GB/s "
               "bidirectional (450 per direction); nvidia-smi 81,559 MiB; ConnectX-7 NDR 400 Gb/s = 50 GB/s "
               "per GPU; PCIe Gen5 x16 128 GB/s bidirectional (64 per direction); host DRAM: DGX H100 has 2 "
               "Xeon Platinum 8480C, 8 DDR5-4800 channels each (Intel ARK) = 614.4 GB/s per node / 8 GPUs"),
    "h200": GPUSpec(
        name="h200", peak_flops=989.4e12, memory_bytes=143771 * 1024**2, hbm_bandwidth=4.8e12,
        scaleup_bandwidth=450e9, scaleout_bandwidth=50e9, host_bandwidth=64e9, host_memory_bandwidth=76.8e9,
        peak_flops_fp8=1979e12, default_efficiency=GPU_DEFAULT_EFFICIENCY["h200"],
        source="NVIDIA H200 datasheet: 141 GB HBM3e, 4.8 TB/s, 1,979 TFLOP/s sparse (989.4 dense) bf16, 3,958 "
               "sparse (1,979 dense) FP8, PCIe Gen5 "
               "128 GB/s; MLPerf H200-SXM-141GBx8 system: 18x NVLink4 900 GB/s, 400G IB; nvidia-smi 143,771 MiB; "
               "host DRAM: DGX H200 has DGX H100's 2 Xeon Platinum 8480C (8 DDR5-4800 channels each) = "
               "614.4 GB/s per node / 8 GPUs"),
    "a100": GPUSpec(
        name="a100", peak_flops=312e12, memory_bytes=81920 * 1024**2, hbm_bandwidth=2.039e12,
        scaleup_bandwidth=300e9, scaleout_bandwidth=25e9, host_bandwidth=32e9, host_memory_bandwidth=51.2e9,
        default_efficiency=GPU_DEFAULT_EFFICIENCY["a100"],
        source="NVIDIA A100 SXM4 80GB datasheet: 312 TFLOP/s dense bf16, 2,039 GB/s HBM2e, NVLink3 600 GB/s "
               "bidirectional, PCIe Gen4 64 GB/s bidirectional; DGX A100 HDR 200 Gb/s = 25 GB/s per GPU; nvidia-smi 81,920 MiB; "
               "host DRAM: DGX A100 has 2 AMD EPYC 7742, 8 DDR4-3200 channels each (AMD spec) = 409.6 GB/s per "
               "node / 8 GPUs"),
    "mi250x": GPUSpec(
        name="mi250x", peak_flops=191.5e12, memory_bytes=64 * 1000**3, hbm_bandwidth=1.6e12,
        scaleup_bandwidth=50e9, scaleout_bandwidth=12.5e9, scaleup_link="xgmi", scaleout_link="slingshot",
        host_bandwidth=36e9, host_memory_bandwidth=25.6e9, default_efficiency=GPU_DEFAULT_EFFICIENCY["mi250x"],
        source="AMD MI250X per GCD: 383 TFLOP/s bf16 per OAM / 2, 64 GB HBM2e and 1.6 TB/s per GCD; "
               "Infinity Fabric link 50 GB/s (cross-package, conservative; same-package GCD pair 200 GB/s); "
               "Frontier 4x Slingshot-11 25 GB/s per node of 8 GCDs = 12.5 GB/s per GCD; CPU-GCD Infinity Fabric "
               "36 GB/s per direction (Frontier user guide); host DRAM: one 64-core EPYC 7A53 with 8 DDR4-3200 "
               "channels = 204.8 GB/s per node / 8 GCDs"),
}
#: One CPU worker process of ``nereus run`` (one Ray actor, one thread). ASSUMED figures, not a
#: datasheet: the runtime replaces ``peak_flops`` with a float32 matmul measured at start-up
#: (``nereus.runtime.run.device_model.cpu_gpu_spec``) and ``memory_bytes`` with its per-worker budget option;
#: gloo over loopback TCP for every collective (one "node").
GPU_PRESETS["cpu"] = GPUSpec(
    name="cpu", peak_flops=20e9, memory_bytes=2 * GIB, hbm_bandwidth=5e9,
    scaleup_bandwidth=0.5e9, scaleout_bandwidth=0.5e9, scaleup_link="gloo", scaleout_link="gloo",
    scaleup_latency=50e-6, scaleout_latency=50e-6, gemm_half_flops=1e6, host_bandwidth=5e9,
    host_memory_bandwidth=5e9,
    source="ASSUMED conservative figures for one single-threaded CPU worker: 20 GFLOP/s fp32 (one AVX2 "
           "core does 30-100), 5 GB/s memory, 0.5 GB/s and 50 us per message for gloo over loopback TCP; "
           "memory is a per-worker budget (default 2 GiB), not a device capacity; GEMM size curve half point "
           "1 MFLOP = ~10 us of per-op framework overhead x ~80 GFLOP/s (time = overhead + flops/peak)")
GPU_PRESETS["h100-sxm"] = GPU_PRESETS["h100"]
GPU_PRESETS["a100-80gb"] = GPU_PRESETS["a100"]
MIB = 1024**2
_DGX_H100_HOST = 76.8e9  # 2 Xeon 8480C x 8 DDR5-4800 channels = 614.4 GB/s per node / 8 GPUs
_DGX_A100_HOST = 51.2e9  # 2 EPYC 7742 x 8 DDR4-3200 channels = 409.6 GB/s per node / 8 GPUs
#: GPUs users run RL post-training on (issue 28). Each ``source`` names the datasheet; capacities are
#: what ``nvidia-smi`` (``rocm-smi``) reports where a public log shows it, else the datasheet's GB
#: (10^9 B, a little under what the driver reports: conservative). PCIe cards without NVLink take the
#: PCIe link as their scale-up link (``scaleup_link="pcie"``). GEMM/attention efficiencies: the same
#: die's measured defaults (H800/H100 PCIe/NVL: H100's; A800, A100-40GB: A100's); the others use the
#: GPU-independent defaults until calibrated. A figure no public source was found for is marked ASSUMED
#: in its ``source`` (checked for issue 28: H20 and MI300X capacity, L20 capacity, NICs, host DRAM).
_NEW_GPUS = {
    "a100-40gb": GPUSpec(
        name="a100-40gb", peak_flops=312e12, memory_bytes=40536 * MIB, hbm_bandwidth=1.555e12,
        scaleup_bandwidth=300e9, scaleout_bandwidth=25e9, host_bandwidth=32e9, host_memory_bandwidth=_DGX_A100_HOST,
        default_efficiency=GPU_DEFAULT_EFFICIENCY["a100"],
        source="NVIDIA A100 datasheet (A100 40GB SXM): 312 TFLOP/s dense bf16, 40 GB HBM2 1,555 GB/s, NVLink3 600 GB/s "
               "bidirectional, PCIe Gen4 64 GB/s bidirectional; nvidia-smi A100-SXM4-40GB 40,536 MiB; DGX A100 HDR "
               "200 Gb/s per GPU"),
    "a800": GPUSpec(
        name="a800", peak_flops=312e12, memory_bytes=81920 * MIB, hbm_bandwidth=2.039e12,
        scaleup_bandwidth=200e9, scaleout_bandwidth=25e9, host_bandwidth=32e9, host_memory_bandwidth=_DGX_A100_HOST,
        default_efficiency=GPU_DEFAULT_EFFICIENCY["a100"],
        source="NVIDIA A800 40GB/80GB SXM datasheet: A100's 312 TFLOP/s dense bf16 and 80 GB HBM2e 2,039 GB/s, NVLink "
               "400 GB/s bidirectional (200 per direction, the export-compliant limit); nvidia-smi as A100 80GB "
               "(81,920 MiB); HDR 200 Gb/s per GPU"),
    "h800": GPUSpec(
        name="h800", peak_flops=989.4e12, memory_bytes=81559 * MIB, hbm_bandwidth=3.35e12,
        scaleup_bandwidth=200e9, scaleout_bandwidth=50e9, host_bandwidth=64e9, host_memory_bandwidth=_DGX_H100_HOST,
        peak_flops_fp8=1979e12, default_efficiency=GPU_DEFAULT_EFFICIENCY["h100"],
        source="NVIDIA H800 SXM5 datasheet: H100 SXM5 compute (989.4 TFLOP/s dense bf16, 1,979 dense FP8), 80 GB HBM3 "
               "3.35 TB/s, NVLink 400 GB/s bidirectional (200 per direction); nvidia-smi as H100 80GB (81,559 MiB); "
               "400 Gb/s NIC per GPU; PCIe Gen5"),
    "h20": GPUSpec(
        name="h20", peak_flops=148e12, memory_bytes=97871 * MIB, hbm_bandwidth=4.0e12,
        scaleup_bandwidth=450e9, scaleout_bandwidth=50e9, host_bandwidth=64e9, host_memory_bandwidth=_DGX_H100_HOST,
        peak_flops_fp8=296e12,
        source="NVIDIA HGX H20 product brief: 148 TFLOP/s dense bf16 (296 sparse), 296 dense FP8, 96 GB HBM3 4.0 TB/s, "
               "NVLink 900 GB/s bidirectional, PCIe Gen5 x16; nvidia-smi 97,871 MiB (checked: nvidia-smi of 8 H20 in "
               "NVIDIA/nvtrust issue 128); 400 Gb/s NIC per GPU ASSUMED (HGX H20 systems as HGX H100)"),
    "l20": GPUSpec(
        name="l20", peak_flops=119.5e12, memory_bytes=46068 * MIB, hbm_bandwidth=0.864e12,
        scaleup_bandwidth=32e9, scaleout_bandwidth=25e9, scaleup_link="pcie", host_bandwidth=32e9,
        host_memory_bandwidth=25.6e9, peak_flops_fp8=239e12, scaleup_latency=10e-6,
        source="NVIDIA L20 datasheet: 119.5 TFLOP/s dense bf16, 239 dense FP8, 48 GB GDDR6 864 GB/s, no NVLink, PCIe "
               "Gen4 x16 64 GB/s bidirectional (GPU-to-GPU over PCIe, 32 per direction); 48 GB GDDR6 384-bit 864 GB/s, "
               "PCIe 4.0 x16, 275 W also in third-party spec tables (technical.city, topcpu.net L20 pages); capacity "
               "46,068 MiB ASSUMED as the L40S's (same AD102 board with ECC; no public nvidia-smi log of an L20 "
               "found); 200 Gb/s NIC per GPU ASSUMED; host DRAM share ASSUMED"),
    "l40s": GPUSpec(
        name="l40s", peak_flops=362.05e12, memory_bytes=46068 * MIB, hbm_bandwidth=0.864e12,
        scaleup_bandwidth=32e9, scaleout_bandwidth=25e9, scaleup_link="pcie", host_bandwidth=32e9,
        host_memory_bandwidth=25.6e9, peak_flops_fp8=733e12, scaleup_latency=10e-6,
        source="NVIDIA L40S datasheet: 362.05 TFLOP/s dense bf16 (733 sparse), 733 dense FP8, 48 GB GDDR6 864 GB/s, "
               "no NVLink, PCIe Gen4 x16 64 GB/s bidirectional (32 per direction); nvidia-smi 46,068 MiB; 200 Gb/s "
               "NIC per GPU ASSUMED (PCIe servers vary: 100-400 Gb/s); host DRAM share ASSUMED"),
    "h100-pcie": GPUSpec(
        name="h100-pcie", peak_flops=756e12, memory_bytes=81559 * MIB, hbm_bandwidth=2.0e12,
        scaleup_bandwidth=64e9, scaleout_bandwidth=50e9, scaleup_link="pcie", host_bandwidth=64e9,
        host_memory_bandwidth=_DGX_H100_HOST, peak_flops_fp8=1513e12, default_efficiency=GPU_DEFAULT_EFFICIENCY["h100"],
        scaleup_latency=10e-6,
        source="NVIDIA H100 PCIe datasheet: 756 TFLOP/s dense bf16 (1,513 sparse), 1,513 dense FP8, 80 GB HBM2e "
               "2.0 TB/s, PCIe Gen5 128 GB/s bidirectional (64 per direction; NVLink bridges join pairs only, so "
               "collectives over 8 GPUs take PCIe); nvidia-smi 81,559 MiB"),
    "h100-nvl": GPUSpec(
        name="h100-nvl", peak_flops=835e12, memory_bytes=95830 * MIB, hbm_bandwidth=3.9e12,
        scaleup_bandwidth=64e9, scaleout_bandwidth=50e9, scaleup_link="pcie", host_bandwidth=64e9,
        host_memory_bandwidth=_DGX_H100_HOST, peak_flops_fp8=1671e12, default_efficiency=GPU_DEFAULT_EFFICIENCY["h100"],
        scaleup_latency=10e-6,
        source="NVIDIA H100 NVL datasheet: 835 TFLOP/s dense bf16 (1,671 sparse), 1,671 dense FP8, 94 GB HBM3 3.9 TB/s, "
               "NVLink bridge 600 GB/s between pairs, PCIe Gen5 128 GB/s bidirectional (64 per direction, what 8-GPU "
               "collectives take); nvidia-smi 95,830 MiB"),
    "mi300x": GPUSpec(
        name="mi300x", peak_flops=1307.4e12, memory_bytes=205822885888, hbm_bandwidth=5.3e12,
        scaleup_bandwidth=448e9, scaleout_bandwidth=50e9, scaleup_link="xgmi", host_bandwidth=64e9,
        host_memory_bandwidth=_DGX_H100_HOST, peak_flops_fp8=2614.9e12,
        source="AMD Instinct MI300X datasheet: 1,307.4 TFLOP/s dense bf16, 2,614.9 dense FP8, 192 GB HBM3 5.3 TB/s, "
               "Infinity Fabric 896 GB/s aggregate bidirectional peer bandwidth (448 per direction), PCIe Gen5 x16 "
               "128 GB/s; rocm-smi VRAM total 205,822,885,888 B (rocminfo's allocatable GLOBAL pool is 201,310,208 KiB "
               "= 206,141,652,992 B, ROCm/legacy-rocm-build issue 4414: the preset is 0.15% lower, conservative); "
               "400 Gb/s NIC per GPU ASSUMED"),
    "b200": GPUSpec(
        name="b200", peak_flops=2250e12, memory_bytes=183359 * MIB, hbm_bandwidth=8.0e12,
        scaleup_bandwidth=900e9, scaleout_bandwidth=50e9, host_bandwidth=64e9, host_memory_bandwidth=_DGX_H100_HOST,
        peak_flops_fp8=4500e12,
        source="NVIDIA DGX B200 datasheet: 72 PFLOP/s FP8 training per 8 GPUs (4.5 PFLOP/s dense FP8, 2.25 dense bf16 "
               "per GPU), 1,440 GB HBM3e and 64 TB/s per 8 GPUs (8 TB/s per GPU), NVLink5 1.8 TB/s bidirectional (900 "
               "per direction), 8x ConnectX-7 400 Gb/s; nvidia-smi 183,359 MiB (TensorRT-LLM issue 10278)"),
}
GPU_PRESETS.update(_NEW_GPUS)
GPU_PRESETS["a100-sxm4-40gb"] = GPU_PRESETS["a100-40gb"]
GPU_PRESETS["h100-94gb"] = GPU_PRESETS["h100-nvl"]


def get_gpu(name: str) -> GPUSpec:
    """A GPU preset by name (case-insensitive), or a custom GPU: a JSON file of GPU fields
    (:meth:`GPUSpec.from_dict`; at least :data:`GPU_REQUIRED`) or the same mapping inline
    (``'{"name": "mygpu", "peak_flops": 4e14, ...}'``).

    Raises:
        ValueError: unknown name (the valid ones are listed), an unreadable or malformed file, or a
            bad field (named).
    """
    import json
    from pathlib import Path

    if isinstance(name, str) and name.lstrip().startswith("{"):
        try:
            return GPUSpec.from_dict(json.loads(name))
        except json.JSONDecodeError as e:
            raise ValueError(f"custom GPU {name[:60]!r}: not valid JSON ({e})") from e
    if isinstance(name, str) and (name.endswith(".json") or "/" in name):
        p = Path(name).expanduser()
        if not p.is_file():
            raise ValueError(f"custom GPU file {name!r} does not exist (give a preset: {sorted(GPU_PRESETS)})")
        try:
            return GPUSpec.from_dict(json.loads(p.read_text()))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"custom GPU file {name!r} is not valid JSON: {e}") from e
    key = name.lower() if isinstance(name, str) else None
    if key not in GPU_PRESETS:
        raise ValueError(f"unknown GPU {name!r}: use one of {sorted(GPU_PRESETS)}, or a JSON file / inline JSON "
                         f"object of GPU fields (at least {list(GPU_REQUIRED)})")
    return GPU_PRESETS[key]


@dataclass(frozen=True)
class ClusterSpec:
    """``num_nodes`` nodes of ``gpus_per_node`` identical GPUs.

    Raises:
        ValueError: at construction, when a count is not a positive integer.
    """

    gpu: GPUSpec
    num_nodes: int
    gpus_per_node: int

    def __post_init__(self) -> None:
        for f in ("num_nodes", "gpus_per_node"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"cluster field {f!r} must be a positive integer, got {v!r}")

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node

    def all_gpus(self) -> frozenset[int]:
        return frozenset(range(self.num_gpus))

    def node_of(self, gpu: int) -> int:
        return gpu // self.gpus_per_node

    def nodes_of(self, gpus) -> set[int]:
        return {g // self.gpus_per_node for g in gpus}

    def spans_nodes(self, gpus) -> bool:
        """True when the GPU set touches more than one node (its collectives then use scale-out)."""
        return len(self.nodes_of(gpus)) > 1

    def link_of(self, gpus) -> tuple[float, float, str]:
        """(bytes/s per direction, latency s, link name) of transfers among ``gpus``: the scale-up link
        inside one node, the scale-out link when the set spans nodes."""
        g = self.gpu
        if self.spans_nodes(gpus):
            return g.scaleout_bandwidth, g.scaleout_latency, g.scaleout_link
        return g.scaleup_bandwidth, g.scaleup_latency, g.scaleup_link

    def check_pool(self, pool) -> frozenset[int]:
        """Validate a pool of GPU ids against this cluster.

        Raises:
            ValueError: empty pool or ids outside ``0 .. num_gpus-1``.
        """
        pool = frozenset(pool)
        if not pool:
            raise ValueError("GPU pool is empty: at least one GPU is needed")
        bad = sorted(g for g in pool if not (isinstance(g, int) and 0 <= g < self.num_gpus))
        if bad:
            raise ValueError(f"GPU pool has ids {bad[:5]} outside 0..{self.num_gpus - 1}")
        return pool

    def to_dict(self) -> dict:
        preset = GPU_PRESETS.get(self.gpu.name) == self.gpu  # a custom GPU travels whole, so it round-trips
        return {"gpu": self.gpu.name if preset else self.gpu.to_dict(), "num_nodes": self.num_nodes,
                "gpus_per_node": self.gpus_per_node}

    @classmethod
    def from_dict(cls, d) -> ClusterSpec:
        """Build from ``{"gpu": preset | mapping, "num_nodes": int, "gpus_per_node": int}``.

        Raises:
            ValueError: not a mapping, a missing or unknown field, or a bad value (named).
        """
        fields = ("gpu", "num_nodes", "gpus_per_node")
        if not isinstance(d, dict):
            raise ValueError(f"job section 'cluster' must be a mapping with {list(fields)}, got {d!r}")
        unknown = sorted(str(k) for k in set(d) - set(fields))
        if unknown:
            raise ValueError(f"unknown cluster field(s) {unknown}; valid: {list(fields)}")
        missing = [k for k in fields if k not in d]
        if missing:
            raise ValueError(f"cluster is missing field(s) {missing}; a cluster needs {list(fields)}, e.g. "
                             '{"gpu": "h100", "num_nodes": 2, "gpus_per_node": 8}')
        gpu = d["gpu"]
        gpu = get_gpu(gpu) if isinstance(gpu, str) else GPUSpec.from_dict(gpu)
        return cls(gpu=gpu, num_nodes=d["num_nodes"], gpus_per_node=d["gpus_per_node"])
