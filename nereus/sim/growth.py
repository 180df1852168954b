"""A SYNTHETIC response-length growth scenario anchored to the paper, with noise fitted to real logs.

No public per-step log of long chain-of-thought growth exists (``shared/traces/SOURCES.md`` §C), so
the default scenario is synthetic and is labelled so wherever it is shown:

* **trend** — the Nereus paper (§3.2, Fig. 4a): for Llama-3.1-8B the generated length grows from
  about 500 to about 8,000 tokens within 1,000 RL steps. We interpolate geometrically,
  ``L(s) = start · (end/start)^(s/over_steps)`` (constant relative growth, 0.28% per step), and hold
  ``end`` afterwards. Geometric growth makes the 30% drift trigger fire every
  ``ln 1.3 / ln 16 · 1000 ≈ 95`` steps, the steady rhythm the paper's ``H_len`` describes.
* **noise** — multiplicative log-normal, i.i.d. per step, ``σ = NOISE_SIGMA``: the standard deviation
  of ``log(length)`` around its 21-step centred moving average in the four real verl logs of
  ``shared/traces/response_length`` (0.0123, 0.0124, 0.0200, 0.0227; mean 0.0169). Their lag-1
  autocorrelation is 0.04–0.15, so independent noise is a fair model.
"""

from __future__ import annotations

import math

import numpy as np

from nereus.sim.traces import LengthTrace

__all__ = ["NOISE_SIGMA", "fit_noise", "growth_scenario"]

#: σ of log response length around its trend, fitted to the real verl logs (module docstring).
NOISE_SIGMA = 0.0169


def fit_noise(lengths, window: int = 21) -> float:
    """σ of ``log(length)`` minus its centred ``window``-step moving average.

    Raises:
        ValueError: fewer than ``window + 1`` positive lengths.
    """
    x = np.asarray(lengths, dtype=float)
    if x.size <= window or np.any(x <= 0):
        raise ValueError(f"fit_noise needs more than {window} positive lengths, got {x.size}")
    lx = np.log(x)
    ma = np.convolve(lx, np.ones(window) / window, mode="valid")
    return float(np.std(lx[window // 2: window // 2 + ma.size] - ma))


def growth_scenario(num_steps: int, start: float = 500.0, end: float = 8000.0, over_steps: int = 1000,
                    sigma: float = NOISE_SIGMA, seed: int = 0) -> LengthTrace:
    """SYNTHETIC per-step mean response lengths (tokens), see the module docstring.

    Raises:
        ValueError: non-positive ``num_steps``, ``start``, ``end`` or ``over_steps``, or ``sigma`` < 0.
    """
    for name, v in (("num_steps", num_steps), ("start", start), ("end", end), ("over_steps", over_steps)):
        if not v > 0:
            raise ValueError(f"growth scenario field {name!r} must be > 0, got {v!r}")
    if sigma < 0:
        raise ValueError(f"growth scenario field 'sigma' must be >= 0, got {sigma!r}")
    rng = np.random.default_rng(seed)
    s = np.arange(num_steps)
    trend = start * np.power(end / start, np.minimum(s, over_steps) / over_steps)
    noise = np.exp(rng.normal(0.0, sigma, num_steps)) if sigma > 0 else np.ones(num_steps)
    lengths = tuple(float(max(1.0, v)) for v in trend * noise)
    name = f"growth {start:g}->{end:g} tokens in {over_steps} steps"
    return LengthTrace(name=name, lengths=lengths, synthetic=True,
                       source=("SYNTHETIC: geometric trend anchored to the Nereus paper (Llama-3.1-8B, ~500 -> "
                               f"~8,000 tokens in 1,000 steps); log-normal noise sigma={sigma:g} fitted to real "
                               "verl logs"),
                       meta={"start": start, "end": end, "over_steps": over_steps, "sigma": sigma,
                             "seed": seed, "crossing_every_steps": math.log(1.3) / math.log(end / start)
                             * over_steps})
