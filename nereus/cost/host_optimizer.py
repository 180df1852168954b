"""Time of the CPU optimizer step of ``offload="cpu_adam"`` (ZeRO-Offload), per optimizer update.

ZeRO-Offload (Ren et al., "ZeRO-Offload: Democratizing Billion-Scale Model Training", USENIX ATC'21,
§4, Fig. 2) keeps the fp32 master weights and Adam moments in host memory; every optimizer update

1. copies each rank's gradient shard to the host (device → host over PCIe),
2. runs Adam on the CPU over that shard (DeepSpeed ``DeepSpeedCPUAdam``),
3. copies the updated weights of the shard back (host → device), after which ZeRO's all-gather
   (already timed by :func:`nereus.cost.latency.dp_sync_time` for ZeRO >= 1) spreads them.

The shard is the rank's parameters ``params_rank(tp, pp)`` over ``dp`` when ZeRO >= 1 (each rank
updates its ``1/dp`` partition) and the whole replica with ZeRO-0. Terms (op class → seconds):

* ``offload@pcie``: ``2 · shard · param_bytes / (host_bandwidth · eff)``, gradients down and
  weights up in the training dtype, the GPU's PCIe ``host_bandwidth``
  (:class:`nereus.spec.hardware.GPUSpec`) at the ``offload@pcie`` efficiency (0.8 by default).
* ``cpu_adam@host``: ``shard · CPU_ADAM_BYTES_PER_PARAM / (host_memory_bandwidth · eff)``. CPU Adam
  is DRAM-bandwidth bound: DeepSpeed's AVX kernel (``csrc/includes/cpu_adam_impl.h``,
  ``Adam_Optimizer::Step_AVX``) reads the fp32 parameter, gradient, ``exp_avg`` and
  ``exp_avg_sq`` (16 B) and writes the three fp32 states back plus the half-precision copy that
  goes to the GPU (12 + 2 B): 30 B per parameter. ``host_memory_bandwidth`` is this GPU's share of
  the node's DRAM bandwidth (all of a node's ranks step at once); the class efficiency defaults to
  the table's 0.5 for unseen classes, below the 70-80% of theoretical that STREAM triad reaches on
  dual-socket servers, since the Adam loop is not a pure stream and shares the sockets with the
  data loaders.

The steps run one after another (no overlap with backward is assumed: DeepSpeed overlaps the
gradient copies only with ``overlap_comm``, and its one-step delayed update changes the
optimization, so it is not modelled). Every function is elementwise over NumPy arrays.
"""

from __future__ import annotations

import numpy as np

from nereus.cost.efficiency import EfficiencyTable
from nereus.cost.memory import OFF_CPU_ADAM
from nereus.cost.shapes import params_rank
from nereus.spec.hardware import ClusterSpec
from nereus.spec.model import ModelSpec
from nereus.spec.workload import WorkloadSpec

__all__ = ["CPU_ADAM_BYTES_PER_PARAM", "cpu_adam_times"]

#: DRAM bytes read or written per parameter by one CPU Adam step (DeepSpeed ``Step_AVX``:
#: fp32 param, grad, exp_avg, exp_avg_sq read; param, exp_avg, exp_avg_sq written; bf16/fp16 copy
#: written for the device).
CPU_ADAM_BYTES_PER_PARAM = 30


def cpu_adam_times(model: ModelSpec, workload: WorkloadSpec, cluster: ClusterSpec, eff: EfficiencyTable,
                   tp, pp, dp, zero, offload) -> dict:
    """Seconds per optimizer update of the host side of ``cpu_adam`` on the most loaded GPU.

    Args:
        tp, pp, dp, zero, offload: arrays of one shape (or scalars); ``offload`` holds codes of
            :data:`nereus.cost.memory.OFFLOAD_CODES`; rows with another mode get 0 s.

    Returns:
        ``{"offload@pcie": seconds, "cpu_adam@host": seconds}``, arrays over rows.
    """
    on = np.asarray(offload) == OFF_CPU_ADAM
    shard = params_rank(model, np.asarray(tp), np.asarray(pp)) / np.where(np.asarray(zero) >= 1, np.asarray(dp), 1)
    gpu = cluster.gpu
    pcie = 2.0 * shard * workload.param_bytes / (gpu.host_bandwidth * eff.get("offload@pcie", gpu))
    adam = shard * CPU_ADAM_BYTES_PER_PARAM / (gpu.host_memory_bandwidth * eff.get("cpu_adam@host", gpu))
    return {"offload@pcie": np.where(on, pcie, 0.0), "cpu_adam@host": np.where(on, adam, 0.0)}
