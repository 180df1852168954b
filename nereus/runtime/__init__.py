"""nereus.runtime: the distributed RL runtime (DESIGN.md §4.7).

Modules, one concept each (imports go down this list, never up):

* ``instrument``: per model-stage and per op-class seconds, tracked peak bytes, bytes sent.
* ``algorithms``: GAE, PPO, GRPO, ReMax losses and advantages.
* ``task``: tokenizer, digit reversal/addition task, rule reward.
* ``comm``: gloo communicators among any subset of workers (``PrefixStore`` + timeout), timed
  collectives, Megatron f/g autograd wrappers.
* ``layout``: logical Llama parameters and their TP/PP sharding rules; shard/unshard.
* ``parallel``: ``Layout`` (tp, pp, dp, worker ids) and the ``ParallelContext`` holding the groups.
* ``model``: one (TP, PP) shard of a Llama decoder, with a KV cache.
* ``pipeline``: GPipe forward/backward over micro-batches.
* ``engine``: the EMU state on a worker (shards, sharded Adam, counters, ``gather_logical_state``).
* ``rollout``: KV-cache generation (temperature sampling, greedy).
* ``worker``: ``WorkerCore`` (one per device) and its Ray actor; hardware inventory.
* ``local``: run workers as plain processes (multi-process checks).
* ``pool``: Ray worker pool and the driver-hosted store.
* ``driver``: the RL loop as the Ray driver; ``measurements()`` for the controller.
* ``cli``: ``nereus run``.
"""
