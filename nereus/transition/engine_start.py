"""The engine-start term of ``L_tran``: seconds a rollout engine (vLLM) takes to start in a new layout.

A live transition of ``actor.generate`` served by vLLM moves the weights like any other (Load from the
training model-stage) and must also start the target layout's engines: spawn the engine-core and TP
worker processes, initialise the model, profile memory and allocate the KV cache. vLLM users report
seconds for small models and minutes at 70B (about 3.5 minutes for a 70B TP8 engine). The term is

    T_start = a + b · W_rank        (W_rank: weight bytes per engine rank, GB)

with ``a`` (fixed process and KV setup) and ``b`` (model build, per GB) calibrated from measured starts by
least squares (:meth:`EngineStartModel.observe`), as the other transition constants are fitted
from measurements (``transition/calibrate.py``, by medians there): one distinct size fixes ``a`` at the mean of its starts with ``b`` kept;
two or more fit both. The replicas' engines start side by side on disjoint workers, so a transition
that changes the layout adds one ``T_start`` (:func:`engine_start_term`); none when the generation
layout does not change. Where the new engines start while the old ones still serve (a pool that grows
onto new workers), ``overlap_s`` of the start is hidden and only the rest is charged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["EngineStartModel", "engine_start_term", "DEFAULT_FIXED_S"]

#: prior fixed start (seconds) before any start was measured: a 2-layer Llama on this project's CPU
#: machine started in about 15 s (issue 25's measurement; replaced by the run's own first start)
DEFAULT_FIXED_S = 15.0


@dataclass
class EngineStartModel:
    """``T_start = fixed_s + per_gb_s · W_rank/1e9``, calibrated from ``(W_rank bytes, seconds)`` samples.

    Raises:
        ValueError: a negative constant, or an observation with negative bytes or non-positive seconds.
    """

    fixed_s: float = DEFAULT_FIXED_S
    per_gb_s: float = 0.0
    samples: list[tuple[float, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        for f in ("fixed_s", "per_gb_s"):
            if not getattr(self, f) >= 0:
                raise ValueError(f"engine start field {f!r} must be >= 0, got {getattr(self, f)!r}")

    def predict(self, weight_bytes_per_rank: float) -> float:
        """Seconds to start one engine holding ``weight_bytes_per_rank`` bytes of weights per rank."""
        if not weight_bytes_per_rank >= 0:
            raise ValueError(f"engine start: weight_bytes_per_rank must be >= 0, got {weight_bytes_per_rank!r}")
        return self.fixed_s + self.per_gb_s * weight_bytes_per_rank / 1e9

    def observe(self, weight_bytes_per_rank: float, seconds: float) -> None:
        """Add a measured start and refit (module docstring)."""
        if not weight_bytes_per_rank >= 0 or not seconds > 0:
            raise ValueError(f"engine start observation needs bytes >= 0 and seconds > 0, got "
                             f"({weight_bytes_per_rank!r}, {seconds!r})")
        self.samples.append((float(weight_bytes_per_rank) / 1e9, float(seconds)))
        xs = [x for x, _ in self.samples]
        ys = [y for _, y in self.samples]
        n = len(xs)
        mx, my = sum(xs) / n, sum(ys) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        if sxx > 0:
            b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
            self.per_gb_s = max(0.0, b)
        self.fixed_s = max(0.0, my - self.per_gb_s * mx)


def engine_start_term(model: EngineStartModel, changes: bool, weight_bytes_per_rank: float,
                      overlap_s: float = 0.0) -> float:
    """Seconds the engine start adds to ``L_tran``: ``max(0, T_start − overlap_s)`` when the generation
    layout ``changes``, else 0."""
    if not changes:
        return 0.0
    if not overlap_s >= 0:
        raise ValueError(f"engine start: overlap_s must be >= 0, got {overlap_s!r}")
    return max(0.0, model.predict(weight_bytes_per_rank) - overlap_s)
