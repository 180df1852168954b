"""The device bytes of a ZeRO-2 engine's gradient reduction in flight (``worker/zero3.py``), for the
worker's meter: the micro-batch gradients of units whose backward is not complete yet, held until the
unit's reduce-scatter, and the flat copies of the unit being reduce-scattered.

Accounted under ``bucket:<engine>`` (``comm/instrument.py``); the cost model's term is the runtime
engine's ZeRO-2 ``bucket`` (``nereus.cost.runtime_memory``).
"""

from __future__ import annotations

__all__ = ["account_bucket"]


def account_bucket(engine, extra: int = 0) -> None:
    """Set ``bucket:<engine>`` to the bytes of ``engine._pending`` (unit -> name -> gradient) plus
    ``extra`` (the unit being reduced: its gradients, flat and padded copies and the output).

    Raises:
        DeviceMemoryError: the tracked total would exceed the worker's capacity.
    """
    pending = engine._pending or {}
    held = sum(t.numel() * t.element_size() for grads in pending.values() for t in grads.values())
    engine.meter.set_static(f"bucket:{id(engine)}", held + int(extra))
