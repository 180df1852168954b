"""Where unannounced losses strike: per-node hit probabilities learned from the losses seen.

Why (issue 29): ``risk.hit_probability`` assumed that a loss event takes nodes uniformly at random
among the pool's nodes. Pools do not lose GPUs that way: capacity that arrived last is usually the
first taken back (in the simulator the GPUs that joined last leave first; on clouds reclaims cluster
by instance type and zone, which a job's newest nodes often share), so the same nodes are hit again
and again while others are never hit. Under the uniform assumption a plan whose only training replica
spans every node (P_hit = 1) looked cheaper than one confined to the nodes that had never been hit
(P_hit = nodes/N), and the controller kept placing its single ``actor.train`` replica on the volatile
nodes: on ``bamboo-gcp-v100`` (Qwen3-32B GRPO, no notice, seed 0, 2 h) it lost its trained state 7
times where ``static``, sitting on the first 16 GPUs, lost it 3 times (docs/simulate.md).

Model (a Beta-Bernoulli estimate per node, the standard conjugate update)::

    q_n = (h_n + α · q0) / (e_n + α)

* ``e_n``: unannounced loss events seen while node ``n`` had GPUs in the pool (its exposure);
* ``h_n``: those of them that took at least one of node ``n``'s GPUs;
* ``q0``: the uniform prior of ``risk.hit_probability``, ``min(1, m / |nodes(pool)|)`` with ``m`` the
  mean event size in nodes, so with no evidence the estimate is exactly the uniform model;
* ``α = 1``: one pseudo-event of prior weight (the weakest prior that keeps ``q_n`` defined and
  away from 0 and 1 after a single event; not fitted to any trace).

Pairs of nodes (issue 29, third round): a loss event does not take whole nodes. The count traces
remove GPUs by id, and a cloud reclaims instances of a zone together, so one event often takes GPUs
of two or more nodes at once: on ``bamboo-gcp-v100`` (70B PPO) a loss of GPUs 44-51 took half of
node 5 and half of node 6, one node of each replica of a redundant plan, and destroyed both. Whether
two replicas can go in the same event is a property of *pairs* of nodes, so pairs get the same
estimate::

    p_ab = (c_ab + α · p0) / (x_ab + α),      p0 = m_h · (m_h − 1) / (N · (N − 1))

* ``x_ab``: events seen while nodes ``a`` and ``b`` both had GPUs in the pool; ``c_ab``: those that
  took GPUs of both;
* ``p0``: the probability that an event taking ``m_h`` distinct nodes uniformly at random among
  ``N`` takes both ``a`` and ``b`` (``m_h`` = :meth:`LossSites.mean_nodes_hit`, the mean number of
  distinct nodes the events seen took; 1 before any event, so the prior of whole-node events is 0).

A node that has not been hit after ``k`` exposures has ``q_n = q0 / (k + 1)``, a node hit in all of
them ``(k + q0) / (k + 1)``. When losses do fall uniformly the estimate converges to the uniform
model (``h_n / e_n → m / N``). Assumptions: node slots keep their identity across leave and rejoin
(a rejoining node takes the slot of the one that left, as ``ClusterSpec`` numbers them), and the
hit pattern does not change within the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nereus.spec.hardware import ClusterSpec

__all__ = ["LossSites", "PRIOR_WEIGHT"]

#: α, the prior's weight in pseudo-events (module docstring)
PRIOR_WEIGHT = 1.0


@dataclass
class LossSites:
    """Per-node exposure and hit counts of unannounced loss events.

    Attributes:
        cluster: the job's cluster (GPU → node).
        exposed: node → loss events seen while the node had GPUs in the pool.
        hits: node → loss events that took at least one of its GPUs.
        events: unannounced loss events seen.
        nodes_hit: distinct nodes those events took, summed (for :meth:`mean_nodes_hit`).
        pair_exposed: ``(a, b)`` with ``a < b`` → events seen while both nodes had GPUs in the pool.
        pair_hits: ``(a, b)`` → those events that took GPUs of both.
    """

    cluster: ClusterSpec
    exposed: dict = field(default_factory=dict)
    hits: dict = field(default_factory=dict)
    events: int = 0
    nodes_hit: int = 0
    pair_exposed: dict = field(default_factory=dict)
    pair_hits: dict = field(default_factory=dict)
    _last_pool: frozenset | None = field(default=None, repr=False)

    def observe(self, pool: frozenset, alive: frozenset) -> frozenset:
        """Record one step report (``P_gpu`` and the GPUs still running); returns the nodes hit by
        an unannounced loss since the last report (GPUs in the last ``P_gpu`` that are no longer
        alive; announced GPUs leave ``P_gpu`` first and are not counted, as in ``risk.LossRate``)."""
        pool, alive = frozenset(pool), frozenset(alive)
        hit: frozenset = frozenset()
        if self._last_pool is not None:
            gone = self._last_pool - alive
            if gone:
                hit = frozenset(self.cluster.node_of(g) for g in gone)
                self.events += 1
                for n in {self.cluster.node_of(g) for g in self._last_pool}:
                    self.exposed[n] = self.exposed.get(n, 0) + 1
                for n in hit:
                    self.hits[n] = self.hits.get(n, 0) + 1
                self.nodes_hit += len(hit)
                up = sorted({self.cluster.node_of(g) for g in self._last_pool})
                for i, a in enumerate(up):
                    for b in up[i + 1:]:
                        self.pair_exposed[(a, b)] = self.pair_exposed.get((a, b), 0) + 1
                        if a in hit and b in hit:
                            self.pair_hits[(a, b)] = self.pair_hits.get((a, b), 0) + 1
        self._last_pool = pool
        return hit

    def probability(self, node: int, prior: float) -> float:
        """``q_n`` for ``node`` given the uniform prior ``q0 = prior`` in [0, 1].

        Raises:
            ValueError: a prior outside [0, 1].
        """
        if not (0.0 <= prior <= 1.0):
            raise ValueError(f"loss-site prior must be a probability in [0, 1], got {prior!r}")
        e, h = self.exposed.get(node, 0), self.hits.get(node, 0)
        return (h + PRIOR_WEIGHT * prior) / (e + PRIOR_WEIGHT)

    def mean_nodes_hit(self) -> float:
        """Mean distinct nodes per event seen (1 before the first)."""
        return self.nodes_hit / self.events if self.events else 1.0

    def pair_probability(self, a: int, b: int, prior: float) -> float:
        """``p_ab``: probability that one event takes GPUs of both nodes ``a`` and ``b`` (module
        docstring), given the uniform prior ``p0 = prior`` in [0, 1] (one node alone:
        :meth:`probability`).

        Raises:
            ValueError: a prior outside [0, 1] or ``a == b``.
        """
        if not (0.0 <= prior <= 1.0):
            raise ValueError(f"loss-site pair prior must be a probability in [0, 1], got {prior!r}")
        if a == b:
            raise ValueError(f"loss-site pair needs two distinct nodes, got {a!r} twice")
        key = (min(a, b), max(a, b))
        x, c = self.pair_exposed.get(key, 0), self.pair_hits.get(key, 0)
        return (c + PRIOR_WEIGHT * prior) / (x + PRIOR_WEIGHT)

    def safest_nodes(self, pool, prior: float) -> list[int]:
        """The pool's nodes, least likely to be hit first (ties: lower node index first)."""
        nodes = sorted({self.cluster.node_of(g) for g in pool})
        return sorted(nodes, key=lambda n: (self.probability(n, prior), n))

    def safest_pools(self, pool, event_gpus: float = 1.0) -> list[frozenset]:
        """``pool`` on its ``k`` safest nodes (:meth:`safest_nodes` under the uniform prior of events
        of ``event_gpus`` GPUs, at least one node), for ``k`` = the pool's node count − 1 down to 1."""
        nodes_n = len({self.cluster.node_of(g) for g in pool})
        m = max(1.0, event_gpus / self.cluster.gpus_per_node)
        order = self.safest_nodes(pool, min(1.0, m / nodes_n) if nodes_n else 0.0)
        keeps = [set(order[:k]) for k in range(len(order) - 1, 0, -1)]
        return [frozenset(g for g in pool if self.cluster.node_of(g) in keep) for keep in keeps]
