"""Which of a plan's features the runtime executes (checked by ``RLDriver.set_plan`` before any worker
builds): ZeRO 0-3 for training model-stages (``worker/zero.py``, ``worker/zero3.py``) and ZeRO-3 for
forward-only ones, idle state resident, offloaded to host memory or dropped
(``worker/memory_pool.py``), plain 1F1B. The planner's ``runtime`` preset
(``nereus.spec.framework``) is kept to this set."""

from __future__ import annotations

from nereus.spec.plan import Candidate

__all__ = ["check_runtime_features", "RUNTIME_ZERO", "RUNTIME_OFFLOAD"]


#: what the runtime executes of a candidate's ZeRO stage and idle-state placement
#: (``worker/zero.py``, ``worker/zero3.py``, ``worker/memory_pool.py``)
RUNTIME_ZERO = (0, 1, 2, 3)
RUNTIME_OFFLOAD = ("none", "host", "drop")


def check_runtime_features(name: str, c: Candidate) -> None:
    """The runtime executes ZeRO 0-3 for training model-stages and ZeRO 0 or 3 for forward-only ones
    (``worker/zero3.py``: parameters sharded over DP, gathered per layer), idle state kept resident,
    offloaded to host memory or dropped (``worker/memory_pool.py``; model-stages sharing workers take
    turns), plain 1F1B (no interleaving); ValueError otherwise."""
    bad = [f"{k}={v!r}" for k, v, ok in (("zero", c.zero, RUNTIME_ZERO), ("offload", c.offload, RUNTIME_OFFLOAD),
                                          ("vpp", c.vpp, (1,))) if v not in ok]
    if bad:
        raise ValueError(f"model-stage {name}: {', '.join(bad)} is not executed by the Nereus runtime (it runs "
                         f"zero in {list(RUNTIME_ZERO)}, offload in {list(RUNTIME_OFFLOAD)}, vpp=1)")
    if c.zero in (1, 2) and not name.endswith(".train"):
        raise ValueError(f"model-stage {name}: zero={c.zero} shards optimizer state or gradients; only training "
                         f"model-stages have them (a forward-only model-stage runs zero 0 or 3)")
