"""nereus.runtime: the distributed RL runtime (DESIGN.md §4.7-§4.9).

Subpackages say where their code runs. Worker-side code runs inside each worker process (one Ray
actor per device); driver-side code runs in the driver, the controller's process. Worker-side code
never imports driver-side code (``tests/test_layering.py``).

Worker side:

* ``comm/``: communicators among any subset of workers (``groups.py``: gloo/NCCL on a ``PrefixStore``,
  timed collectives, Megatron f/g wrappers), the ``Layout`` and ``ParallelContext`` a worker holds in
  one model-stage (``parallel.py``), and the per-worker ``Meter`` (``instrument.py``).
* ``model/``: what a parameter is and how a shard computes: logical Llama parameters and their TP/PP
  sharding rules (``sharding.py``), run precisions (``precision.py``), one (TP, PP) shard of a Llama
  decoder with its KV cache (``llama.py``), Hugging Face checkpoints read per shard (``hf.py``).
* ``worker/``: the worker itself: ``WorkerCore`` and its Ray actor (``core.py``), device and dtype
  choice (``device.py``), the EMU engine with sharded Adam (``engine.py``) and its logical state
  (``logical_state.py``), pipeline schedules (``pipeline.py``), KV-cache rollouts (``rollout.py``),
  heartbeats, rollback point and fault injection (``fault_tolerant.py``), the two failure exceptions
  (``failures.py``).
* ``rl/``: pure tensor code both sides use: RL advantages and losses (``algorithms.py``), the built-in
  verifiable task (``task.py``), datasets in verl's layout with rule rewards (``data.py``).

Both halves of one mechanism, in one package:

* ``transit/``: live transitions. ``plans.py`` (pure: which piece of which tensor moves from which
  worker to which, computed alike by sender and receiver), ``worker_side.py`` (units and primitives run
  on a worker), ``driver_side.py`` (the executor: checks the DAG and schedule, submits primitives,
  never receives a state tensor).
* ``durable/``: DCP checkpoints. ``worker_side.py`` (one engine's shards to and from a checkpoint) and
  ``worker_calls.py`` (the checkpoint calls a worker answers),
  ``driver_side.py`` (which replica writes, completion, restart), ``scheduling.py`` (when an adaptive
  run takes, completes and swaps them).

Driver side:

* ``run/``: the RL loop as the Ray driver (``driver.py``, ``config.py``), one-step-off asynchronous RL
  (``async_driver.py``), the adaptive run (``adaptive.py``) and its recovery from lost workers
  (``recovery.py``; ``faults.py``: the heartbeat watch), the worker pool and its store (``pool.py``),
  plans the runtime builds itself (``plans.py``), the re-shard through the driver (``relayout.py``),
  how the planners see this runtime's devices (``device_model.py``), scenario schedules
  (``schedules.py``), reports (``memreport.py``, ``report.py``), and workers as plain local processes
  for multi-process checks (``local.py``).

The command front ends (``nereus run``) are in :mod:`nereus.cli`.
"""
